"""Hand-written safetensors reader/writer (torch 1.13 has no safetensors package).

File layout: 8-byte little-endian u64 N, then N bytes of JSON header
{"name": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
 "__metadata__": {str: str}}, then the raw little-endian tensor data; offsets are
relative to the start of the data section. Tensors are written in sorted name order,
row-major (C order), float32.

    /usr/bin/python3 examples/tinylm/train/export.py CKPT.pt OUT.safetensors
converts a torch checkpoint written by train.py --ckpt.
"""
import json
import struct
import sys

import numpy as np
import torch


def save_safetensors(model_or_sd, path, meta=None):
    sd = model_or_sd.state_dict() if hasattr(model_or_sd, "state_dict") else model_or_sd
    names = sorted(sd)
    header, blobs, off = {}, [], 0
    for n in names:
        a = sd[n].detach().cpu().float().contiguous().numpy().astype("<f4")
        b = a.tobytes(order="C")
        header[n] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    if meta:
        header["__metadata__"] = {str(k): str(v) for k, v in meta.items()}
    hj = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hj += b" " * ((8 - len(hj) % 8) % 8)   # pad so the data section is 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for b in blobs:
            f.write(b)


def load_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", {})
    data = raw[8 + n:]
    out = {}
    for name, h in header.items():
        assert h["dtype"] == "F32"
        b, e = h["data_offsets"]
        out[name] = torch.from_numpy(np.frombuffer(data[b:e], dtype="<f4").reshape(h["shape"]).copy())
    return out, meta


def load_model(path):
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
    from model import Config, TinyLM
    sd, meta = load_safetensors(path)
    cfg = Config(**json.loads(meta["config"]))
    m = TinyLM(cfg)
    m.load_state_dict(sd)
    m.eval()
    return m, meta


if __name__ == "__main__":
    ck = torch.load(sys.argv[1])
    save_safetensors(ck["model"], sys.argv[2], meta={"config": json.dumps(ck["config"])})
