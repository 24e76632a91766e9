"""Environment checks of one host: the usual causes of distributed failures.

Each check is a pure function of what it is given (the environment, the host's interfaces...), so
that tests can hand it any host; ``local_checks()`` gathers the real inputs. Each result is pass,
warn or fail with one line of detail and one line of fix. Torch is imported only for versions.
"""

from __future__ import annotations

import os
import platform
import resource
import shutil
import socket
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

PASS, WARN, FAIL = "pass", "warn", "fail"
SHM_MIN_BYTES = 1 << 30
NOFILE_MIN = 65536


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def _names(value: str) -> list[str]:
    return [n.strip() for n in value.split(",") if n.strip()]


def interface_matches(spec: str, interfaces: list[str], nccl: bool) -> list[str]:
    """Interfaces a *_SOCKET_IFNAME value selects. NCCL: prefixes, ``=name`` exact, ``^...`` excludes;
    gloo: exact names, comma-separated."""
    if nccl:
        exclude = spec.startswith("^")
        body = spec[1:] if exclude else spec
        exact = body.startswith("=")
        names = _names(body[1:] if exact else body)
        hit = [i for i in interfaces if any(i == n if exact else i.startswith(n) for n in names)]
        return [i for i in interfaces if i not in hit and i != "lo"] if exclude else hit
    return [i for i in interfaces if i in _names(spec)]


def check_variables(env: dict[str, str], interfaces: list[str], has_ib: bool) -> list[Check]:
    """NCCL_*, TORCH_NCCL_*, GLOO_* and MASTER_* values known to break or slow distributed jobs."""
    out: list[Check] = []
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        value = env.get(var)
        if value is None:
            continue
        if interface_matches(value, interfaces, nccl=var.startswith("NCCL")):
            out.append(Check(var, PASS, f"{var}={value} selects an interface of this host"))
        else:
            out.append(Check(var, FAIL, f"{var}={value} names no interface of this host (it has: "
                                        f"{', '.join(interfaces) or 'none'}): the process group cannot start",
                             f"set {var} to one of {', '.join(i for i in interfaces if i != 'lo') or 'lo'}, or unset "
                             "it"))
    for var in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"):
        if env.get(var) == "0":
            out.append(Check(var, WARN, f"{var}=0 turns off asynchronous error handling: a NCCL error or timeout "
                                        "then hangs the job instead of failing it (distdebug's stall detection "
                                        "still catches the hang)",
                             f"unset {var}: PyTorch's default (3) is what makes NCCL errors and timeouts fail the job"))
    for var in ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"):
        if env.get(var) == "1":
            out.append(Check(var, WARN, f"{var}=1: the CPU waits for every collective (slower; meant for "
                                        "debugging)", f"unset {var}"))
    if env.get("NCCL_IB_DISABLE") == "1" and has_ib:
        out.append(Check("NCCL_IB_DISABLE", WARN, "NCCL_IB_DISABLE=1 on a host with InfiniBand devices: "
                                                  "inter-node traffic falls back to TCP sockets",
                         "unset NCCL_IB_DISABLE"))
    if env.get("NCCL_P2P_DISABLE") == "1":
        out.append(Check("NCCL_P2P_DISABLE", WARN, "NCCL_P2P_DISABLE=1: GPUs of one node exchange through host "
                                                   "memory instead of NVLink/PCIe peer access",
                         "unset NCCL_P2P_DISABLE unless a driver bug needs it"))
    if env.get("NCCL_DEBUG", "").upper() == "TRACE":
        out.append(Check("NCCL_DEBUG", WARN, "NCCL_DEBUG=TRACE logs every call: slow and huge logs",
                         "NCCL_DEBUG=INFO (or WARN) for diagnosis"))
    for var, lo, hi, why in (("NCCL_IB_TIMEOUT", 14, 24, "the InfiniBand retry timeout exponent"),
                             ("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", 60, 3600, "seconds before the watchdog kills a "
                                                                             "stuck process group")):
        value = env.get(var)
        if value is None:
            continue
        try:
            n = int(value)
        except ValueError:
            out.append(Check(var, FAIL, f"{var}={value} is not a number ({why})", f"unset {var}"))
            continue
        if n < lo:
            out.append(Check(var, WARN, f"{var}={n} is short ({why}): a busy fabric or a slow rank is taken "
                                        "for a failure", f"{var}={lo} or more, or unset it"))
        elif n > hi:
            out.append(Check(var, WARN, f"{var}={n} is long ({why}): a real failure takes that long to surface",
                             f"{var}={hi} or less, or unset it"))
    return out


def check_master(env: dict[str, str], check_port_free: bool) -> list[Check]:
    out: list[Check] = []
    port_s = env.get("MASTER_PORT")
    if port_s is not None:
        try:
            port = int(port_s)
            if not 0 < port < 65536:
                raise ValueError
        except ValueError:
            return [Check("MASTER_PORT", FAIL, f"MASTER_PORT={port_s} is not a port number",
                          "a free TCP port such as 29500")]
        if check_port_free:
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("", port))
                    out.append(Check("MASTER_PORT", PASS, f"port {port} is free on this host"))
                except OSError:
                    out.append(Check("MASTER_PORT", WARN, f"port {port} is in use on this host: a rendezvous "
                                                          "here cannot listen on it", "choose another MASTER_PORT"))
    addr = env.get("MASTER_ADDR")
    if addr is not None:
        try:
            socket.getaddrinfo(addr, None)
            out.append(Check("MASTER_ADDR", PASS, f"MASTER_ADDR={addr} resolves"))
        except OSError:
            out.append(Check("MASTER_ADDR", FAIL, f"MASTER_ADDR={addr} does not resolve from this host",
                             "the master node's address as this host can reach it"))
    return out


def check_limits(shm_bytes: int | None, nofile: int | None) -> list[Check]:
    out: list[Check] = []
    if shm_bytes is not None:
        gib = shm_bytes / (1 << 30)
        if shm_bytes < SHM_MIN_BYTES:
            out.append(Check("/dev/shm", WARN, f"/dev/shm holds {gib:.2f} GiB: DataLoader workers and NCCL's "
                                               "shared-memory transport run out (a container's default is 64 MB)",
                             "docker run --shm-size=16g (or --ipc=host)"))
        else:
            out.append(Check("/dev/shm", PASS, f"/dev/shm holds {gib:.1f} GiB"))
    if nofile is not None:
        if nofile < NOFILE_MIN:
            out.append(Check("open files", WARN, f"open-file limit {nofile}: many ranks, DataLoader workers and "
                                                 "sockets can exhaust it", f"ulimit -n {NOFILE_MIN}"))
        else:
            out.append(Check("open files", PASS, f"open-file limit {nofile}"))
    return out


def parse_topology(text: str) -> tuple[list[str], dict[tuple[str, str], str]]:
    """``nvidia-smi topo -m`` -> (GPU names, {(gpu a, gpu b): link}) for GPU pairs."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return [], {}
    header = lines[0].split()
    gpus = [h for h in header if h.startswith("GPU")]
    links: dict[tuple[str, str], str] = {}
    for ln in lines[1:]:
        cells = ln.split()
        if not cells or not cells[0].startswith("GPU") or cells[0] not in gpus:
            continue
        for j, other in enumerate(gpus):
            if j + 1 < len(cells) and other != cells[0]:
                links[(cells[0], other)] = cells[j + 1]
    return gpus, links


def check_topology(text: str | None, mig: list[str]) -> list[Check]:
    out: list[Check] = []
    if text:
        gpus, links = parse_topology(text)
        slow = sorted({tuple(sorted(p)) for p, link in links.items() if not link.startswith("NV")})
        if slow:
            pairs = ", ".join(f"{a}-{b} ({links[(a, b)]})" for a, b in slow[:12])
            out.append(Check("GPU topology", WARN, f"GPU pairs joined only through PCIe or the CPU interconnect, "
                                                   f"no NVLink: {pairs}", "keep tensor-parallel groups on "
                                                                          "NVLink-connected GPUs"))
        elif gpus:
            out.append(Check("GPU topology", PASS, f"{len(gpus)} GPUs, every pair over NVLink"))
    enabled = [i for i, m in enumerate(mig) if m.strip().lower() == "enabled"]
    if enabled:
        out.append(Check("MIG", WARN, f"MIG is on for GPU(s) {enabled}: each slice is a separate device with a "
                                      "fraction of the memory and no NVLink", "nvidia-smi -mig 0 unless slices "
                                                                               "are meant"))
    return out


def versions() -> Check:
    import torch

    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    parts.append(f"CUDA {torch.version.cuda}" if torch.version.cuda else "CUDA none (CPU build)")
    try:
        nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
        if nccl:
            parts.append("NCCL " + ".".join(map(str, nccl)))
    except Exception:  # no NCCL in this build
        pass
    try:  # the installed version, without importing deepspeed (slow, and it logs on import)
        from importlib.metadata import version

        parts.append(f"deepspeed {version('deepspeed')}")
    except Exception:  # not installed
        parts.append("deepspeed not installed")
    driver = _nvidia_smi(["--query-gpu=driver_version", "--format=csv,noheader"])
    if driver:
        parts.append(f"driver {driver.splitlines()[0].strip()}")
    return Check("versions", PASS, ", ".join(parts))


def _nvidia_smi(args: list[str]) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        return subprocess.run([exe, *args], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def local_inputs() -> tuple[list[str], bool, int | None, int | None]:
    interfaces = [name for _, name in socket.if_nameindex()]
    ib = Path("/sys/class/infiniband")
    has_ib = ib.is_dir() and any(ib.iterdir())
    try:
        st = os.statvfs("/dev/shm")
        shm: int | None = st.f_frsize * st.f_blocks
    except OSError:
        shm = None
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return interfaces, has_ib, shm, (None if nofile == resource.RLIM_INFINITY else nofile)


ASSUMED_RANKS = 8
"""Ranks a node runs, for the volume check when no launcher says (a node of eight GPUs)."""


def check_volume(env: dict[str, str]) -> Check:
    """The log-volume guard's static part (doctor.volume): the run directory's bound against its file system's
    free space, and the logging the environment turns on. Inside a launch its run directory, budget and ranks
    per node; bare, the default runs folder, the default budget and ``ASSUMED_RANKS``."""
    from distdebug import envvars
    from distdebug.artifacts.runs import runs_root
    from distdebug.config import RUN_DIR_BUDGET
    from distdebug.doctor.volume import static_lines

    run_dir = env.get(envvars.RUN_DIR) or str(runs_root())
    budget = int(env.get(envvars.RUN_DIR_BUDGET) or RUN_DIR_BUDGET)
    ranks = int(env.get("LOCAL_WORLD_SIZE") or ASSUMED_RANKS)
    warn, lines, fixes = static_lines(env, run_dir=run_dir, budget=budget, ranks=ranks)
    return Check("log volume", WARN if warn else PASS, "; ".join(lines), "; ".join(fixes))


def local_checks(env: dict[str, str] | None = None) -> list[Check]:
    """Every check of this host, for ``distdebug doctor``."""
    env = dict(os.environ) if env is None else env
    interfaces, has_ib, shm, nofile = local_inputs()
    out = [versions()]
    topo = _nvidia_smi(["topo", "-m"])
    mig = (_nvidia_smi(["--query-gpu=mig.mode.current", "--format=csv,noheader"]) or "").splitlines()
    if topo is None:
        out.append(Check("GPUs", PASS, "no nvidia-smi on this host: GPU checks skipped"))
    out += check_topology(topo, mig)
    out += check_variables(env, interfaces, has_ib)
    out += check_master(env, check_port_free=True)
    out += check_limits(shm, nofile)
    out.append(check_volume(env))
    return out
