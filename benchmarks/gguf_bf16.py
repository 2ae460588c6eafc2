"""Write a BF16 (or F16) copy of a GGUF file: every quantized tensor dequantized and stored as BF16, metadata kept.

llama.cpp then runs the same weights magicdec computes with (magicdec dequantizes the shipped Q4_1 GGUF and
computes in bf16 on CPUs with AVX512-BF16, and over fp16 weights on the AVX2 kernels), so `bench_llamacpp.py`
compares engines, not quantizations.

    python benchmarks/gguf_bf16.py [--f16] [SRC.gguf] OUT.gguf     (default SRC: the embedded default model)
"""

from __future__ import annotations

import sys

import gguf
import numpy as np
import torch

from magicdec.loading import default_model_path


#: torch dtype, GGML tensor type and GGUF file type of each 16-bit format.
FORMATS = {"bf16": (torch.bfloat16, gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
           "f16": (torch.float16, gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16)}


def to_bf16(src: str, out: str, fmt: str = "bf16") -> None:
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, field.contents(), vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, field.contents(), vtype)
    dtype, tensor_type, file_type = FORMATS[fmt]
    writer.add_file_type(file_type)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)  # [.., ne0] numpy order
        if t.tensor_type == gguf.GGMLQuantizationType.F32 and values.ndim == 1:  # norms stay fp32
            writer.add_tensor(t.name, values)
            continue
        half = torch.from_numpy(np.ascontiguousarray(values)).to(dtype).view(torch.int16).numpy()
        writer.add_tensor(t.name, half, raw_shape=values.shape, raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    args = sys.argv[1:]
    fmt = "f16" if "--f16" in args else "bf16"
    args = [a for a in args if a != "--f16"]
    if len(args) not in (1, 2):
        sys.exit(__doc__)
    to_bf16(*(args if len(args) == 2 else [str(default_model_path()), args[0]]), fmt)
