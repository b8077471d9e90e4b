import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # tests never touch the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import pytest  # noqa: E402

from tiny import tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and the CPUs may be shared: one thread is quicker
    (two threads on a busy machine spin-wait; seen 50x slower)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """Folder of a tiny random Llama target (seed 0)."""
    return str(tiny_llama(tmp_path_factory.mktemp("tiny_target"), seed=0, layers=4, scale=8.0))


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory):
    """Folder of a smaller tiny random Llama (seed 1) sharing the target's tokenizer."""
    return str(tiny_llama(tmp_path_factory.mktemp("tiny_draft"), seed=1, layers=2, scale=8.0))


@pytest.fixture(scope="session")
def embedded():
    from engine.models import load_model

    return load_model("embedded")
