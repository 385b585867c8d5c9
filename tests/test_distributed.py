"""The fast encoder under torch.distributed: DDP and FSDP2 on CPU (gloo, two ranks).

Each rank takes half of one batch; one training step must give the gradients and parameters
that single-process training on the whole batch gives (the reference BERTEncoder, loss
divided by the world size because both wrappers average gradients over ranks). Tolerance:
fp32, |error| <= 1e-5 + 1e-5 * max|expected| per tensor.

FSDP means FSDP2 (fully_shard), which runs on CPU with gloo; FSDP1 (FullyShardedDataParallel)
runs there given device_id=cpu, and is tested with its flat parameters (use_orig_params=False:
the Linears' weights become plain tensors, not Parameters). DDP also runs compiled
(torch.compile of the DDP module, aot_eager).

Starting a rank costs about 6 s of imports on the 2-core test machine and a scenario a few
milliseconds, so the two ranks are started once per module and run the scenarios the tests
send them. Ranks collect their comparisons and report them at the end of a scenario instead
of raising mid-way: a rank that raised between collectives would leave the other waiting.
"""

import datetime
import gc
import os
import queue
import time
import traceback
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from bert_fast import FastBERTEncoder
from bert_fast import reference as R
from bert_fast.backend import resolve_backend
from bert_fast.modules import _back_to_back_view
from tests.helpers import autograd_node_names, encoder_config, max_err

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with the gloo backend")

WORLD_SIZE = 2
B, L = 4, 13                      # L not a multiple of 16; B splits evenly over the ranks
VALID_LENS = [7, 13, 0, 4]        # rank 0 gets [7, 13], rank 1 [0, 4] (an empty sequence)
ATOL = RTOL = 1e-5
LR = 0.1
SCENARIO_TIMEOUT_S = 240          # torch.compile of forward and backward is the slowest (~30 s)
COLLECTIVE_TIMEOUT_S = 120        # a rank stuck in a collective fails instead of hanging


def _config():
    return encoder_config(num_heads=2, head_dim=16, num_layers=2, vocab_size=50, max_len=32)


# ---------------------------------------------------------------------------------------------
# Inside the ranks


class _Checks:
    """Comparisons made in a rank, sent to the test at the end of the scenario."""

    def __init__(self):
        self.failures, self.count, self.worst = [], 0, 0.0

    def close(self, actual, expected, what):
        self.count += 1
        if actual.shape != expected.shape:
            self.failures.append(f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
            return
        err = max_err(actual, expected)
        bound = ATOL + RTOL * max_err(expected, torch.zeros_like(expected))
        self.worst = max(self.worst, err)
        if not err <= bound:
            self.failures.append(f"{what}: max abs error {err:.3g} > {bound:.3g}")

    def true(self, condition, what):
        self.count += 1
        if not condition:
            self.failures.append(what)

    def report(self):
        return dict(failures=self.failures, count=self.count, worst=self.worst)


def _batch(cfg, valid_lens):
    """The whole batch, the same on every rank: tokens, segments, valid_lens, and the weights
    of the loss sum(output * weights)."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg["vocab_size"], (B, L), generator=gen)
    segments = torch.randint(0, 2, (B, L), generator=gen)
    weights = torch.randn(B, L, cfg["num_hiddens"], generator=gen)
    return tokens, segments, torch.tensor(valid_lens), weights


def _reference(cfg, learn_pos_embedding):
    """The single-process model. The reference BERTEncoder has no learnable position table, so
    with learn_pos_embedding the reference is a torch-backend FastBERTEncoder (itself checked
    against BERTEncoder in test_modules / test_skip_padding) with the same weights."""
    torch.manual_seed(0)
    ref = R.BERTEncoder(**cfg)
    if not learn_pos_embedding:
        return ref
    fast = FastBERTEncoder(**cfg, backend="torch", learn_pos_embedding=True)
    fast.load_state_dict(ref.state_dict(), strict=True)
    return fast


def _loss_mask(valid_lens, skip_padding):
    """The positions the loss and the comparisons cover: skip_padding leaves padded positions
    zero by contract (the reference computes values there), so then valid positions only."""
    if skip_padding:
        return torch.arange(L, dtype=torch.float32)[None, :] < valid_lens[:, None]
    return torch.ones(valid_lens.shape[0], L, dtype=torch.bool)


def _reference_step(ref, tokens, segments, valid_lens, weights, skip_padding):
    """One SGD step on the whole batch; returns the output before the step."""
    out = ref(tokens, segments, valid_lens)
    mask = _loss_mask(valid_lens, skip_padding)[..., None]
    # DDP and FSDP average the ranks' gradients: (g_0 + g_1) / 2 is the gradient of this.
    ((out * weights * mask).sum() / WORLD_SIZE).backward()
    torch.optim.SGD(ref.parameters(), lr=LR).step()
    return out.detach()


def _full(tensor):
    """A plain tensor of the whole value (FSDP2 keeps DTensor shards; a collective)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _compare_grads_and_params(checks, model, ref, where):
    """Gradients after the step's backward and parameters after its update, by name.
    Every rank calls this in the same order (full_tensor is a collective)."""
    params = dict(model.named_parameters())
    checks.true(params.keys() == dict(ref.named_parameters()).keys(),
                f"{where}: parameter names {sorted(params)} differ from the reference's")
    for name, ref_param in ref.named_parameters():
        param = params.get(name)
        if param is None:
            continue
        grad = None if param.grad is None else _full(param.grad)
        if ref_param.grad is None:
            # The reference has no gradient (pos_embedding, the book's quirk): none, or zeros.
            checks.true(grad is None or not grad.any(), f"{where}: {name} has a nonzero gradient "
                        f"where the reference has none")
        else:
            checks.true(grad is not None, f"{where}: {name} has no gradient")
            if grad is not None:
                checks.close(grad, ref_param.grad, f"{where}: grad {name}")
        checks.close(_full(param.detach()), ref_param.detach(), f"{where}: {name} after the step")


class _LocalBatch:
    """This rank's share of the batch, and the comparisons every scenario makes on it."""

    def __init__(self, rank, checks, tokens, segments, valid_lens, weights, skip_padding):
        mine = slice(rank * B // WORLD_SIZE, (rank + 1) * B // WORLD_SIZE)
        self.checks, self.where = checks, f"rank {rank}"
        self.inputs = tokens[mine], segments[mine], valid_lens[mine]
        self.weights = weights[mine]
        self.mine, self.skip_padding = mine, skip_padding
        self.mask = _loss_mask(valid_lens[mine], skip_padding)

    def check_eval(self, model, ref, label):
        """A no-grad eval forward (the packed-QKV view's path) against the reference's."""
        model.eval(), ref.eval()
        with torch.no_grad():
            out, expected = model(*self.inputs), ref(*self.inputs)
        self.checks.close(out[self.mask], expected[self.mask], f"{self.where}: eval output {label}")
        model.train(), ref.train()

    def train_step(self, run, optimizer, ref_out):
        out = run(*self.inputs)
        (out * self.weights * self.mask[..., None]).sum().backward()
        optimizer.step()
        out = out.detach()
        self.checks.close(out[self.mask], ref_out[self.mine][self.mask], f"{self.where}: training output")
        if self.skip_padding:
            self.checks.true(not out[~self.mask].any(), f"{self.where}: padded positions are not zero")


def _eval_step_eval(local, wrapped, model, ref, optimizer, batch):
    """An eval forward, one training step of ``wrapped`` against the reference's on the whole
    ``batch`` (gradients and parameters of ``model`` compared by name), an eval forward."""
    local.check_eval(wrapped, ref, "before training")
    ref_out = _reference_step(ref, *batch, local.skip_padding)
    local.train_step(wrapped, optimizer, ref_out)
    _compare_grads_and_params(local.checks, model, ref, local.where)
    local.check_eval(wrapped, ref, "after the step")


def _scenario_ddp(rank, *, backend, valid_lens, skip_padding=False, learn_pos_embedding=False,
                  pack_qkv=False, compile=False):
    checks = _Checks()
    cfg = _config()
    tokens, segments, valid_lens, weights = _batch(cfg, valid_lens)
    local = _LocalBatch(rank, checks, tokens, segments, valid_lens, weights, skip_padding)
    ref = _reference(cfg, learn_pos_embedding)
    # Rank 1 starts from other weights: DDP's broadcast from rank 0 must reach all the state.
    torch.manual_seed(100 + rank)
    model = FastBERTEncoder(**cfg, backend=backend, skip_padding=skip_padding,
                            learn_pos_embedding=learn_pos_embedding)
    if rank == 0:
        model.load_state_dict(ref.state_dict(), strict=True)
    if pack_qkv:
        model.pack_qkv_()
    # Without learn_pos_embedding no gradient reaches pos_embedding (as in the reference),
    # so DDP has to be told that a parameter may go unused.
    ddp = DistributedDataParallel(model, find_unused_parameters=not learn_pos_embedding)
    if pack_qkv:     # DDP's broadcast copies into the packed storage, in place
        attention = model.blks[0].attention
        checks.true(_back_to_back_view([attention.W_q.weight, attention.W_k.weight,
                                        attention.W_v.weight]) is not None,
                    f"{local.where}: W_q/W_k/W_v not packed under DDP (the eval checks would test nothing)")
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    if compile:
        # Training only: an eval pass would compile a second graph. aot_eager: what DDP changes
        # is Dynamo's (its DDP optimizer splits the graph at bucket boundaries) and AOTAutograd's
        # (the backward's gradient hooks); Inductor's lowering of the same ops is
        # test_compile.py's, and cost the two ranks ~40 s of both cores here.
        torch._dynamo.reset()
        ref_out = _reference_step(ref, tokens, segments, valid_lens, weights, skip_padding)
        local.train_step(torch.compile(ddp, backend="aot_eager"), optimizer, ref_out)
        _compare_grads_and_params(checks, model, ref, local.where)
        checks.true(torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1,
                    f"{local.where}: torch.compile captured no graph")
        return checks.report()
    _eval_step_eval(local, ddp, model, ref, optimizer, (tokens, segments, valid_lens, weights))
    return checks.report()


def _scenario_fsdp1(rank, *, backend, valid_lens):
    """FSDP1 with flat parameters: the fast modules must call the modules whose weight is a
    plain tensor (they read Parameters: KeyError 'weight'). The flat names are not the
    reference's: the training output and the eval output after the step are compared."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    checks = _Checks()
    cfg = _config()
    tokens, segments, valid_lens, weights = _batch(cfg, valid_lens)
    local = _LocalBatch(rank, checks, tokens, segments, valid_lens, weights, skip_padding=False)
    ref = _reference(cfg, learn_pos_embedding=False)
    model = FastBERTEncoder(**cfg, backend=backend)
    model.load_state_dict(ref.state_dict(), strict=True)
    wrapped = FullyShardedDataParallel(model, use_orig_params=False, device_id=torch.device("cpu"))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)
    local.check_eval(wrapped, ref, "before training")
    local.train_step(wrapped, optimizer, _reference_step(ref, tokens, segments, valid_lens, weights, False))
    local.check_eval(wrapped, ref, "after the step")
    return checks.report()


def _cpu_mesh():
    """The ranks' CPU mesh: fully_shard's default mesh is on CUDA where there is a GPU, which would
    move the shards there, away from the CPU reference and gloo."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (WORLD_SIZE,))


def _scenario_fsdp(rank, *, backend, valid_lens, pack_qkv=None, skip_padding=False):
    """pack_qkv: None, "before_wrap" or "after_wrap" (on the DTensor shards)."""
    from torch.distributed.fsdp import fully_shard

    checks = _Checks()
    cfg = _config()
    tokens, segments, valid_lens, weights = _batch(cfg, valid_lens)
    local = _LocalBatch(rank, checks, tokens, segments, valid_lens, weights, skip_padding)
    ref = _reference(cfg, learn_pos_embedding=False)
    model = FastBERTEncoder(**cfg, backend=backend, skip_padding=skip_padding)
    model.load_state_dict(ref.state_dict(), strict=True)     # fully_shard does not broadcast
    if pack_qkv == "before_wrap":
        model.pack_qkv_()
        attention = model.blks[0].attention
        checks.true(_back_to_back_view([attention.W_q.weight, attention.W_k.weight,
                                        attention.W_v.weight]) is not None,
                    f"{local.where}: pack_qkv_() did not pack (the scenario would test nothing)")
    original = weakref.ref(model.blks[0].attention.W_q.weight)
    mesh = _cpu_mesh()
    for blk in model.blks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # Before any forward: FSDP2 leaves the root's parameters unsharded after a forward (until
    # its backward), and an optimizer built then would hold those temporary tensors.
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    sharded = model.blks[0].attention.W_q.weight
    checks.true(type(sharded).__name__ == "DTensor",
                f"{local.where}: fully_shard left W_q.weight a {type(sharded).__name__}, not a DTensor")
    if pack_qkv == "after_wrap":
        model.pack_qkv_()
    _eval_step_eval(local, model, model, ref, optimizer, (tokens, segments, valid_lens, weights))
    gc.collect()
    # The packed QKV made at construction held the unsharded W_q/W_k/W_v: a full copy per layer.
    checks.true(original() is None, f"{local.where}: the unsharded W_q is still alive after a step")
    return checks.report()


def _scenario_hf(rank, *, wrapper, backend, skip_padding=False, checkpointing=False):
    """A Hugging Face BertModel after bert_fast.optimize() under DDP or FSDP2, against the same
    HF model (eager attention, not optimized) trained on the whole batch in this process; with
    ``checkpointing``, HF's gradient checkpointing (non-reentrant) set on the optimized model
    before it is wrapped."""
    import copy

    from transformers import BertConfig, BertModel

    import bert_fast
    from bert_fast.hf import HFFallbackWarning
    from torch.distributed.fsdp import fully_shard

    checks = _Checks()
    cfg = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=48, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    tokens, segments, valid_lens, weights = _batch(dict(vocab_size=50, num_hiddens=32), VALID_LENS)
    mask = _loss_mask(valid_lens, skip_padding=True).long()     # the tokenizer's prefix mask
    # Not the outputs of the sequence whose mask is all zeros: they are the mean of its values,
    # and HF's eager attention (the reference) sends a gradient to its queries and keys that
    # ours does not send (bert_fast.hf's docstring; test_hf covers that row alone).
    keep = (_loss_mask(valid_lens, skip_padding) & (valid_lens > 0)[:, None])[..., None]
    # The fused path must run under the wrapper, not HF's forward as a fallback.
    warnings.simplefilter("error", HFFallbackWarning)
    torch.manual_seed(0)
    ref = BertModel(cfg)
    ref.set_attn_implementation("eager")
    model = bert_fast.optimize(copy.deepcopy(ref), backend, skip_padding=skip_padding)
    if checkpointing:
        from bert_fast.host_bench import checkpoint_layers
        checkpoint_layers(model, use_reentrant=False)
    ref_out = ref(tokens, mask, segments).last_hidden_state
    ((ref_out * weights * keep).sum() / WORLD_SIZE).backward()
    torch.optim.SGD(ref.parameters(), lr=LR).step()

    if wrapper == "ddp":
        wrapped = DistributedDataParallel(model, find_unused_parameters=True)    # the pooler: no loss
    else:
        mesh = _cpu_mesh()
        for layer in model.encoder.layer:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped = model
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)
    mine = slice(rank * B // WORLD_SIZE, (rank + 1) * B // WORLD_SIZE)
    out = wrapped(tokens[mine], mask[mine], segments[mine]).last_hidden_state
    where = f"rank {rank} ({wrapper}, HF)"
    if checkpointing:
        checks.true("_RecomputedEncoderLayerBackward" in autograd_node_names(out),
                    f"{where}: the fused layers did not checkpoint themselves")
    (out * weights[mine] * keep[mine]).sum().backward()
    optimizer.step()
    checks.close(out.detach() * keep[mine], ref_out.detach()[mine] * keep[mine], f"{where}: training output")
    _compare_grads_and_params(checks, model, ref, where)
    return checks.report()


_SCENARIOS = {"ddp": _scenario_ddp, "fsdp": _scenario_fsdp, "fsdp1": _scenario_fsdp1, "hf": _scenario_hf}


def _serve(rank, store_path, task_queues, results):
    """A rank: join the process group, then run scenarios until told to stop (None)."""
    tasks = task_queues[rank]
    torch.set_num_threads(1)      # two ranks on two cores
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        while (task := tasks.get()) is not None:
            name, kwargs = task
            try:
                results.put((rank, True, _SCENARIOS[name](rank, **kwargs)))
            except BaseException:
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# In the test process


class _Ranks:
    """The two rank processes, started on first use and again after a failed scenario (whose
    collectives may have left the group out of step)."""

    def __init__(self, directory):
        self.directory, self.context, self.starts = directory, None, 0

    def _start(self):
        spawn = mp.get_context("spawn")
        self.tasks = [spawn.SimpleQueue() for _ in range(WORLD_SIZE)]
        self.results = spawn.Queue()
        self.starts += 1
        store = os.path.join(self.directory, f"store{self.starts}")
        # daemon: the ranks go when the test process exits, however it exits.
        self.context = mp.spawn(_serve, args=(store, self.tasks, self.results),
                                nprocs=WORLD_SIZE, join=False, daemon=True)

    def _death_report(self):
        """torch's spawn wrapper records a dead rank's traceback; join() raises it."""
        try:
            self.context.join(timeout=1)
        except Exception as error:      # ProcessRaisedException / ProcessExitedException
            return str(error)
        return "a rank process exited"

    def stop(self, graceful=True):
        if self.context is None:
            return
        if graceful:
            for tasks in self.tasks:
                tasks.put(None)
        for process in self.context.processes:
            process.join(timeout=10 if graceful else 0)
            if process.is_alive():
                process.terminate()
                process.join(timeout=10)
        self.context = None

    def run(self, scenario, **kwargs):
        """Every rank's report of ``scenario``; fails the test with the ranks' tracebacks if
        one raised, died or did not answer in time."""
        if self.context is None:
            self._start()
        for tasks in self.tasks:
            tasks.put((scenario, kwargs))
        answers, errors = {}, {}
        deadline = time.monotonic() + SCENARIO_TIMEOUT_S
        while len(answers) + len(errors) < WORLD_SIZE and time.monotonic() < deadline:
            try:
                rank, ok, payload = self.results.get(timeout=1.0)
            except queue.Empty:
                if not all(p.is_alive() for p in self.context.processes):
                    errors["exit"] = self._death_report()
                    break
                continue
            (answers if ok else errors)[rank] = payload
            if errors:       # the other rank may wait in a collective: give it a moment only
                deadline = min(deadline, time.monotonic() + 5)
        if errors or len(answers) < WORLD_SIZE:
            self.stop(graceful=False)
            missing = sorted(set(range(WORLD_SIZE)) - answers.keys() - errors.keys())
            text = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in errors.items())
            pytest.fail(f"scenario {scenario}{kwargs} failed; no answer from ranks {missing}\n{text}",
                        pytrace=False)
        return [answers[rank] for rank in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    group = _Ranks(str(tmp_path_factory.mktemp("process_group")))
    yield group
    group.stop()


def _assert_reports(reports):
    for rank, report in enumerate(reports):
        assert report["count"] > 0, f"rank {rank} compared nothing"
        assert not report["failures"], f"rank {rank}:\n" + "\n".join(report["failures"])
    print(f"worst abs error over ranks: {max(r['worst'] for r in reports):.2e}")


def _usable(backend):
    try:
        resolve_backend(backend)
    except ValueError as why:
        pytest.skip(f"backend {backend!r} is not usable here: {why}")
    return backend


# ---------------------------------------------------------------------------------------------
# DDP


@pytest.mark.parametrize("backend", ["torch", "triton", "cuda"])
def test_ddp_step_matches_single_process(ranks, backend):
    _assert_reports(ranks.run("ddp", backend=_usable(backend), valid_lens=VALID_LENS))


@pytest.mark.parametrize("valid_lens", [VALID_LENS, [9, 13, 0, 0]],
                         ids=["both_ranks_valid", "rank1_no_valid_token"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_ddp_skip_padding_step_matches_single_process(ranks, backend, valid_lens):
    """skip_padding: the loss covers valid positions only (padded outputs are zeros by contract).
    In the second case rank 1 packs no token at all and must still take part in the reduction."""
    _assert_reports(ranks.run("ddp", backend=backend, valid_lens=valid_lens, skip_padding=True))


def test_ddp_learnable_position_table(ranks):
    """Every parameter gets a gradient, so plain DDP (no find_unused_parameters) works."""
    _assert_reports(ranks.run("ddp", backend="torch", valid_lens=VALID_LENS, learn_pos_embedding=True))


def test_ddp_after_pack_qkv(ranks):
    """pack_qkv_() before wrapping: DDP's broadcast fills the packed storage in place,
    training concatenates, and the no-grad eval passes read the packed view."""
    _assert_reports(ranks.run("ddp", backend="torch", valid_lens=VALID_LENS, pack_qkv=True))


def test_ddp_compiled(ranks):
    """torch.compile(DDP(model)): the DDP optimizer splits the graph at bucket boundaries."""
    _assert_reports(ranks.run("ddp", backend="torch", valid_lens=VALID_LENS,
                              learn_pos_embedding=True, compile=True))


# ---------------------------------------------------------------------------------------------
# FSDP2 (fully_shard; CPU parameters, gloo)


@pytest.mark.parametrize("backend", ["torch", "triton", "cuda"])
def test_fsdp_step_matches_single_process(ranks, backend):
    _assert_reports(ranks.run("fsdp", backend=_usable(backend), valid_lens=VALID_LENS))


@pytest.mark.parametrize("valid_lens", [VALID_LENS, [9, 13, 0, 0]],
                         ids=["both_ranks_valid", "rank1_no_valid_token"])
def test_fsdp_skip_padding(ranks, valid_lens):
    """In the second case rank 1 packs no token: its QKV weights must still get (zero)
    gradients, or FSDP's reduce-scatter sends fewer bytes there (gloo aborted the process)."""
    _assert_reports(ranks.run("fsdp", backend="torch", valid_lens=valid_lens, skip_padding=True))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fsdp1_flat_parameters(ranks, backend):
    _assert_reports(ranks.run("fsdp1", backend=backend, valid_lens=VALID_LENS))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fsdp_after_pack_qkv(ranks, backend):
    """pack_qkv_() before fully_shard: the shards are DTensors with no packed view, and the
    no-grad eval forward and the training step still match."""
    _assert_reports(ranks.run("fsdp", backend=backend, valid_lens=VALID_LENS, pack_qkv="before_wrap"))


def test_fsdp_pack_qkv_on_the_shards(ranks):
    """pack_qkv_() after fully_shard (a user preparing a sharded model for inference) runs on
    DTensor shards; FSDP must still gather the live values, before and after a step."""
    _assert_reports(ranks.run("fsdp", backend="torch", valid_lens=VALID_LENS, pack_qkv="after_wrap"))


# ---------------------------------------------------------------------------------------------
# Hugging Face models after optimize()


@pytest.mark.parametrize("skip_padding", [False, True])
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_hf_model_step_matches_single_process(ranks, backend, wrapper, skip_padding):
    pytest.importorskip("transformers")
    _assert_reports(ranks.run("hf", wrapper=wrapper, backend=backend, skip_padding=skip_padding))


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_hf_model_with_gradient_checkpointing_matches_single_process(ranks, wrapper):
    """The fused layers checkpointing themselves (HF's gradient checkpointing) under DDP's
    gradient hooks and FSDP2's unshard and reshard around each layer's forward and backward."""
    pytest.importorskip("transformers")
    _assert_reports(ranks.run("hf", wrapper=wrapper, backend="triton", checkpointing=True))
