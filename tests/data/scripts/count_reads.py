"""Run a training script and count the device-to-host reads distdebug makes on the training thread.

Usage: count_reads.py OUT_DIR SCRIPT [ARGS...] (under ``distdebug attach``). Each rank writes
OUT_DIR/reads-rank<R>.json: {"boundary": {step: count}, "elsewhere": count, "sites": [...]}.

A read is a call of Tensor.item / tolist / cpu / numpy / __float__ / __bool__ / __int__ / __index__
(what stalls the host on a GPU). It is distdebug's when the code that asked for it is: the calling
frame is in the distdebug package, or torch code that a distdebug frame called (not one of
distdebug's wrappers passing the script's own call through to torch). "boundary": inside the step
boundary (Session.boundary), counted by the step it ends; "elsewhere": anywhere else while training
runs (forward and backward hooks, patched collectives, backward), which must stay 0.
"""

import json
import os
import runpy
import sys
import threading

import torch

OUT, SCRIPT = sys.argv[1], sys.argv[2]
sys.argv = [SCRIPT, *sys.argv[3:]]
PKG = os.sep + "distdebug" + os.sep
TORCH = os.path.dirname(torch.__file__) + os.sep
PASS_THROUGH = {("detector.py", "call_original"), ("detector.py", "patched")}  # runtime/detector.py
counts = {"boundary": {}, "elsewhere": 0, "sites": []}


def _ours(frame):
    skipped = 0
    while frame is not None and frame.f_code.co_filename.startswith(TORCH):
        frame, skipped = frame.f_back, skipped + 1
    if frame is None or PKG not in frame.f_code.co_filename or "count_reads" in frame.f_code.co_filename:
        return None
    name = (os.path.basename(frame.f_code.co_filename), frame.f_code.co_name)
    if skipped and (name in PASS_THROUGH or name[0] == "patches.py"):
        return None  # the script's own call, passed through to torch by a wrapper of ours
    return frame


def _phase(frame):
    while frame is not None:
        code = frame.f_code
        if code.co_name == "boundary" and code.co_filename.endswith(os.path.join("runtime", "session.py")):
            return "boundary"
        frame = frame.f_back
    return "elsewhere"


def _counted(method, original):
    def read(self, *args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            frame = _ours(sys._getframe(1))
            if frame is not None:
                from distdebug.runtime.session import current_session

                session = current_session()
                step = session.step if session is not None else -1
                if _phase(frame) == "boundary":
                    counts["boundary"][step] = counts["boundary"].get(step, 0) + 1
                else:
                    counts["elsewhere"] += 1
                if len(counts["sites"]) < 50:
                    counts["sites"].append(f"step {step} {method}: {frame.f_code.co_filename.split(PKG)[-1]}:"
                                           f"{frame.f_lineno} ({frame.f_code.co_name})")
        return original(self, *args, **kwargs)
    return read


for _m in ("item", "tolist", "cpu", "numpy", "__float__", "__bool__", "__int__", "__index__"):
    setattr(torch.Tensor, _m, _counted(_m, getattr(torch.Tensor, _m)))

def _dump():
    with open(os.path.join(OUT, f"reads-rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(counts, f)


_exit = os._exit


def _dump_and_exit(code):  # the recipes leave with os._exit after destroying their process group
    _dump()
    _exit(code)


os._exit = _dump_and_exit
try:
    runpy.run_path(SCRIPT, run_name="__main__")
finally:
    _dump()
