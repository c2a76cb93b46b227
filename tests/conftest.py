import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# two threads, or OMP_NUM_THREADS where it is set: the 1-thread lane (CONTRIBUTING.md, "ISA and thread lanes")
# runs the 1-process references with another blocking of their sums
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0) or min(2, os.cpu_count() or 1))
# precision=auto follows the CPU (bf16 with AVX512-BF16/AMX, else fp32), and CPUs differ between
# machines: the suite takes the fp32 path on every CPU unless told otherwise. Tests marked ``bf16``
# take the bf16-capable path on every CPU (see _cpu_bf16_lane). Numeric tests pin precision anyway.
os.environ.setdefault("TFORMER_CPU_BF16", "0")


def pytest_configure(config):
    """Each lane (``-m``) and forced ISA compiles into an inductor cache of its own (set before any
    test compiles; the processes a test starts inherit it). A cache chosen in the environment wins."""
    from train_helpers import inductor_cache_dir

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir(config.option.markexpr or "")))


TINY = [
    "bert-tiny",
    "modernbert-tiny",
    "gpt2-tiny",
    "llama-tiny",
    "t5-tiny",
    "t5-v1.1-tiny",
    "mixtral-tiny",
    "qwen2-moe-tiny",
    "deepseek-v3-tiny",
    "qwen3-tiny",
    "qwen3-moe-tiny",
    "gemma3-tiny",
    "t5gemma-tiny",
]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_process_group_outlives_its_test():
    """A test that runs a trainer in this process (a world of one under FSDP2, say) may leave the
    default process group up; the next test (e.g. 'refused before any process group') must not
    find it. Nor its rendezvous variables: ``init_distributed`` sets MASTER_PORT in this process's
    environment, and every process a later test starts would inherit it and race for that one port
    (CI failed with EADDRINUSE on it)."""
    saved = {k: os.environ.get(k) for k in _RENDEZVOUS}
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def _cpu_bf16_lane(request, monkeypatch):
    """The bf16 lane: in a test marked ``bf16`` this CPU counts as bf16-capable, so precision=auto
    resolves to bf16 here and in every process the test starts (they inherit the environment)."""
    if request.node.get_closest_marker("bf16"):
        monkeypatch.setenv("TFORMER_CPU_BF16", "1")


@pytest.fixture(params=["0", "1"], ids=["cpu-fp32", "cpu-bf16"])
def cpu_bf16(request, monkeypatch):
    """Runs a test as on both kinds of CPU: without native bf16 matmuls (False) and with them (True)."""
    monkeypatch.setenv("TFORMER_CPU_BF16", request.param)
    return request.param == "1"


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """The data cache (trained tokenizers, tokenized corpora) of every test that trains: entries are
    keyed by their content (source, tokenizer, settings), so tests share them and each is built once
    per session. TFORMER_CACHE points at it until the session ends, then is restored."""
    path = tmp_path_factory.mktemp("tformer-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TFORMER_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from a second thread, and lose a lot when the cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped, with the reason, where no GPU is visible."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _fork_server_ends_with_the_session():
    """Multi-rank tests start their ranks from one fork server (train_helpers.start_ranks); it ends
    with the session."""
    yield
    from train_helpers import stop_fork_server

    stop_fork_server()
