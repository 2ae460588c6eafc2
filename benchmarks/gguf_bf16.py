"""Write a BF16 copy of a GGUF file: every quantized tensor dequantized and stored as BF16, metadata kept.

llama.cpp then runs the same weights magicdec computes with (magicdec dequantizes the shipped Q4_1 GGUF and
computes in bf16 on CPUs with AVX512-BF16), so `bench_llamacpp.py` compares engines, not quantizations.

    python benchmarks/gguf_bf16.py [SRC.gguf] OUT.gguf     (default SRC: the embedded default model)
"""

from __future__ import annotations

import sys

import gguf
import numpy as np
import torch

from magicdec.loading import default_model_path


def to_bf16(src: str, out: str) -> None:
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
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)  # [.., ne0] numpy order
        if t.tensor_type == gguf.GGMLQuantizationType.F32 and values.ndim == 1:  # norms stay fp32
            writer.add_tensor(t.name, values)
            continue
        bf16 = torch.from_numpy(np.ascontiguousarray(values)).to(torch.bfloat16).view(torch.int16).numpy()
        writer.add_tensor(t.name, bf16, raw_shape=values.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) not in (1, 2):
        sys.exit(__doc__)
    to_bf16(*(args if len(args) == 2 else [str(default_model_path()), args[0]]))
