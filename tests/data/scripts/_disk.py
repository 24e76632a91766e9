"""One value changed on disk, as a partial write or a bad copy would: a bit of one float's exponent in a
checkpoint file, for the framework scripts' ``--corrupt-on-disk`` (what checkpoint_roundtrip must name)."""

import json
import zipfile


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x01]))


def corrupt_torch_zip(path: str) -> None:
    """The first storage of a ``torch.save`` zip file (the first tensor pickled), its first float."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    _flip(path, info.header_offset + 30 + name_len + extra_len + 3)


def corrupt_safetensors(path: str) -> str:
    """The first tensor stored in a safetensors file, its first float; returns the tensor's name."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    name = min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    _flip(path, 8 + n + header[name]["data_offsets"][0] + 3)
    return name
