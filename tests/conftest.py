import os
import sys
import time
from pathlib import Path

# Two cores: one thread per rank, and gloo on loopback.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

# DeepSpeed JIT-loads a CPU op (deepspeed_shm_comm) at every engine start, under a lock file in torch's
# extensions directory. Shared by every virtualenv (~/.cache/torch_extensions), two environments
# rebuild it in turn (their build files differ), each build holding the lock for a minute under load;
# and a rank killed while holding it (a test's timeout) leaves the lock behind, on which every later
# DeepSpeed run waits forever. One directory per virtualenv, and a lock older than any build is stale.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
STALE_LOCK_S = 15 * 60


def _remove_stale_locks(root: Path) -> None:
    for lock in root.glob("*/*/lock"):
        try:
            if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
                lock.unlink()
                print(f"conftest: removed a stale torch extension build lock: {lock}", file=sys.stderr)
        except OSError:
            pass


_remove_stale_locks(Path(os.environ["TORCH_EXTENSIONS_DIR"]))
