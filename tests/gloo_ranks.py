"""Launch a rank script as two (or more) real processes on a gloo process group, for the tests that
compare trainmem with what torch.distributed really allocates on the CPU.

``run_ranks`` writes the script, picks a free local port for the env:// rendezvous (``MASTER_ADDR``,
``MASTER_PORT``: ``torch/distributed/rendezvous.py`` ``_env_rendezvous_handler``), starts one process per
rank with ``argv = [rank, *args]`` and fails the test with the tail of a rank's stderr if it exits non-zero.
The script writes its own results; the caller reads them.
"""
import os
import socket
import subprocess
import sys


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script_path, script_text: str, *args, ranks: int = 2, timeout: float = 240) -> None:
    """Run ``script_text`` (saved at ``script_path``) as ``ranks`` processes: ``python script rank *args``,
    one thread each (``OMP_NUM_THREADS=1``), and wait for all."""
    script_path.write_text(script_text)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script_path), str(r), *map(str, args)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(ranks)]
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-2000:]
