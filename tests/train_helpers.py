"""Helpers for trainer tests: small configs on the bundled corpus, subprocess runs, metric reading,
and deadlines for what a test starts (commands and spawned rank groups), which kill it on expiry."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def inductor_cache_dir(markexpr: str, environ: dict | os._Environ = os.environ) -> Path:
    """Inductor's cache for one lane of the suite (``markexpr``: pytest's ``-m``) at one vector ISA
    (``ATEN_CPU_CAPABILITY``, else the machine's own) and thread count (``OMP_NUM_THREADS``).
    Inductor's own cache keys do not tell the forced-ISA lanes apart: a kernel compiled with
    ``ATEN_CPU_CAPABILITY=avx2`` was loaded by the next default-lane run on an AVX512-BF16 CPU and
    aborted it, so each lane and ISA compiles into a directory of its own (CONTRIBUTING.md, "ISA and
    thread lanes")."""
    import getpass
    import re
    import tempfile

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (some containers)
        user = str(os.getuid())
    lane = re.sub(r"[^a-z0-9]+", "-", markexpr.lower()).strip("-") or "all"
    isa = environ.get("ATEN_CPU_CAPABILITY") or "native"
    threads = environ.get("OMP_NUM_THREADS") or "auto"
    return Path(tempfile.gettempdir()) / f"torchinductor_{user}" / f"tformer-{lane}-{isa}-threads{threads}"


def small_overrides(recipe: str, out: Path, *extra: str) -> list[str]:
    base = [
        f"output_dir={out}",
        # the same arithmetic on every CPU: the recipes' precision=auto is bf16 on an AVX512-BF16 one
        # (a later precision=... in extra wins)
        "precision=fp32",
        "progress=false",
        "log_every=1",
        "eval_batches=4",
        "model.vocab_size=2048",
        "model.d_model=64",
        "model.d_ff=128",
        "model.num_layers=2",
        "data.seq_len=64",
        "micro_batch_size=8",
    ]
    if recipe.startswith(("t5", "switch")):
        base += ["model.d_head=16", "data.tokenizer_max_rows=4000"]
    if recipe.startswith("transformer"):
        base += [
            "data.tokenizer_max_rows=3000",
            "data.target_len=64",
            "data.tokens_per_batch=256",
            "model.max_seq_len=64",
            "max_time=null",
            "bleu_samples=4",
            "decode.max_new_tokens=8",
            "decode.num_beams=2",
        ]
    if recipe.startswith("llama"):
        base += ["model.d_ff=96"]
    return base + list(extra)


def env(cache: Path) -> dict:
    e = dict(os.environ)
    e["TFORMER_CACHE"] = str(cache)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


def run_cli(args: list[str], cache: Path, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    return run_cmd([sys.executable, "-m", "tformer", *args], timeout, env=env(cache), **kw)


# -- deadlines: a test that starts processes ends them, whatever ends the test ----------------------


def start(cmd: list, **kw) -> subprocess.Popen:
    """Popen in a session of its own, so that kill_group reaches the command and all it started
    (a launcher's workers, a tokenizer's pool), not only the process itself."""
    kw.setdefault("text", True)
    return subprocess.Popen([str(c) for c in cmd], start_new_session=True, **kw)


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.kill()
    proc.wait()


@contextlib.contextmanager
def owned(*procs: subprocess.Popen):
    """Kills every process group in procs when the block fails: an assertion, an expired deadline,
    or pytest-timeout's per-test one (it raises in the test's thread)."""
    try:
        yield procs
    except BaseException:
        for p in procs:
            kill_group(p)
        raise


def reap(procs, timeout: float) -> list:
    """Every process's (stdout, stderr), all within one deadline; on expiry all are killed and the
    test fails naming the command still running."""
    import pytest

    deadline = time.monotonic() + timeout
    with owned(*procs):
        try:
            return [p.communicate(timeout=max(0.1, deadline - time.monotonic())) for p in procs]
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"still running after {timeout:.0f} s, killed: {' '.join(map(str, e.cmd))[:300]}")


def run_cmd(cmd: list, timeout: float, **kw) -> subprocess.CompletedProcess:
    """subprocess.run(capture_output=True, text=True) whose deadline also kills what the command started.
    ``python -m MODULE ...`` and ``python SCRIPT.py ...`` run in a child of the fork server (see
    ``run_python``), the rest in a new process."""
    cmd = [str(c) for c in cmd]
    python = cmd[0] == sys.executable and len(cmd) > 1 and (cmd[1] == "-m" or cmd[1].endswith(".py"))
    if python and set(kw) <= {"env", "cwd"}:
        return run_python(cmd[1:], timeout, **kw)
    proc = start(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
    out, err = reap([proc], timeout)[0]
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _python_main(argv: list[str], environ: dict, cwd: str | None, out: str, err: str) -> None:
    """What ``python *argv`` does in a fresh interpreter, in a child of the fork server: its own
    session (a deadline kills all it started), the given environment and directory, its output in
    files, the module or script run as ``__main__``, the exit functions run, the exit code kept."""
    import atexit
    import runpy
    import threading
    import traceback

    os.setsid()
    os.environ.clear()
    os.environ.update(environ)
    if cwd:
        os.chdir(cwd)
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, out, os.O_WRONLY), (2, err, os.O_WRONLY)):
        f = os.open(path, flags)
        os.dup2(f, fd)
        os.close(f)
    if "OMP_NUM_THREADS" in environ:  # a fresh interpreter's torch reads it at start
        import torch

        torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))
    code: int = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit code 1
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads, as at interpreter exit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_python(argv: list[str], timeout: float, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """``python *argv`` forked from the fork server, which has imported torch and the trainer (a new
    interpreter spends ~5 s of CPU importing them; the suite starts dozens)."""
    import tempfile

    import pytest

    ctx = _fork_server()
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        out.touch()
        err.touch()
        environ = dict(os.environ if env is None else env)
        proc = ctx.Process(target=_python_main, args=(argv, environ, None if cwd is None else str(cwd), str(out), str(err)))
        proc.start()
        try:
            proc.join(timeout)
            if proc.exitcode is None:
                pytest.fail(f"still running after {timeout:.0f} s, killed: python {' '.join(argv)[:300]}")
        except BaseException:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.kill()
            proc.join()
            raise
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # what it started and left behind, as a new session's end would
        text = [p.read_text(errors="replace") for p in (out, err)]
    return subprocess.CompletedProcess([sys.executable, *argv], proc.exitcode, *text)


def start_python(argv: list, log: Path, env: dict | None = None):
    """``python *argv`` forked from the fork server and not waited for (a multiprocessing Process in
    a session of its own: ``kill_python`` ends it and all it started); stdout to ``log``, stderr to
    ``log`` with ``.err`` appended."""
    err = Path(f"{log}.err")
    for path in (log, err):
        Path(path).write_text("")
    environ = dict(os.environ if env is None else env)
    proc = _fork_server().Process(target=_python_main, args=([str(a) for a in argv], environ, None, str(log), str(err)))
    proc.start()
    return proc


def kill_python(proc) -> None:
    """kill -9 of a ``start_python`` process and everything in its session, then reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.kill()
    proc.join()


# Ranks start from a fork server that imported torch and the trainer once per test session: a spawned
# rank imports them itself (~5 s of CPU each; a 2-rank group on 2 cores ~8-16 s before its first
# step, measured on a 2-core EPYC), a forked one starts in ~0.05 s. A forked rank would see the fork
# server's environment, not this process's: the environment of the moment travels with each start.
PRELOAD = [
    "torch",
    "torch._dynamo",  # torch.optim imports it on the first optimizer (1.3 s)
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "torch.profiler",
    "tformer.train.trainer",
    "deepspeed",  # 0.7 s, torchao 1 s (neither starts a thread at import)
    "torchao.float8",
]


def _fork_server():
    """The multiprocessing context whose processes fork from the session's server (started on first
    use with PRELOAD imported)."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(PRELOAD)
    return multiprocessing.get_context("forkserver")


def _rank_main(rank: int, environ: dict, worker, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environ)
    worker(rank, *args)


def start_ranks(worker, args: tuple, nprocs: int):
    """torch.multiprocessing's context of ``nprocs`` ranks running worker(rank, *args), not joined."""
    import torch.multiprocessing as mp

    _fork_server()  # the preloads, before the server starts
    return mp.start_processes(
        _rank_main, args=(dict(os.environ), worker, args), nprocs=nprocs, join=False, start_method="forkserver"
    )


def stop_fork_server() -> None:
    """End the fork server (at the end of the session: tests leave no process behind)."""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()


def spawn_ranks(worker, args: tuple, nprocs: int, timeout: float) -> None:
    """A group of ``nprocs`` ranks (worker(rank, *args)), joined within a deadline; on expiry or any
    failure every worker is killed and the test fails."""
    import pytest

    ctx = start_ranks(worker, args, nprocs)
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                pytest.fail(f"{nprocs}-process group did not finish in {timeout:.0f} s; killed")
    except BaseException:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        raise


def metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir)}


def recipe_curve(recipe: str, out: Path, steps: int = 200) -> dict[int, float]:
    """The training loss by step (every 10th) of ``configs/{recipe}.yaml`` at test size
    (``small_overrides``), ``steps`` steps in one process, no evaluation or checkpoint."""
    from tformer.train.config import load_config
    from tformer.train.trainer import Trainer

    overrides = small_overrides(recipe, out, f"max_steps={steps}", "eval_every=0", "save_every=0", "log_every=10")
    Trainer(load_config(CONFIGS / f"{recipe}.yaml", overrides)).fit()
    return losses(out)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def become_rank(rank: int, world: int, port: int, cache, collective_timeout: int = 300) -> None:
    """A spawned test worker's torchrun-like environment (one thread each: 4 ranks share 2 cores)."""
    import torch

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TFORMER_CACHE=str(cache),
        TFORMER_DIST_TIMEOUT=str(collective_timeout),
    )
    torch.set_num_threads(1)
