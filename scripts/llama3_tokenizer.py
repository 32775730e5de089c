"""Write a Llama 3 tokenizer folder (tokenizer.json) for benchmarks on `--load-format dummy` checkpoints,
from the tiktoken file that the `llama-models` package ships (no model hub needed):

    pip download --no-deps llama-models -d /tmp/lm && pip install tiktoken
    python scripts/llama3_tokenizer.py /tmp/lm/llama_models-*.whl .tok/llama3
"""
from __future__ import annotations

import sys
import tempfile
import zipfile

# Llama 3's pre-tokenizer split and its 256 special tokens, in id order after the 128,000 BPE tokens.
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
NAMED = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
         "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
         "<|eot_id|>", "<|python_tag|>", "<|image|>"]
SPECIAL = NAMED + [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(NAMED))]


def main(wheel: str, out_dir: str) -> None:
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as z:
            path = z.extract("llama_models/llama3/tokenizer.model", tmp)
        converted = TikTokenConverter(vocab_file=path, pattern=PATTERN, additional_special_tokens=SPECIAL).converted()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=converted, bos_token="<|begin_of_text|>",
                                        eos_token="<|eot_id|>")
    assert tokenizer.encode("Hello world", add_special_tokens=False) == [9906, 1917], "not Llama 3's ranks"
    tokenizer.save_pretrained(out_dir)
    print(f"{out_dir}: {len(tokenizer)} tokens")


if __name__ == "__main__":
    main(*sys.argv[1:3])
