"""Build a tiny random Llama (weights + locally trained tokenizer) as a HF model directory.

No model can be downloaded here, so vLLM tests run on this: hidden 256, 2 layers, 4 heads
(head_dim 64: the CPU attention kernel crashes on head_dim 16), a byte-level BPE tokenizer
trained on generated text. Deterministic: same seed, same files.

Run with the vLLM venv's interpreter (it has torch, transformers and tokenizers):

    $SD_VLLM_VENV/bin/python scripts/make_tiny_model.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
from pathlib import Path

_WORD_TEXT = (
    "the a an of to in and is was for on with as by at from that this it be are or "
    "not model token draft verify batch load speed latency request server queue step "
    "accept reject speculative decoding target prefill cache memory compute time rate "
    "one two three four five six seven eight nine ten red green blue fast slow small "
    "large"
)
WORDS = _WORD_TEXT.split()


def corpus(seed: int, lines: int = 4000) -> list[str]:
    """Pseudo-English lines with digits and punctuation, so BPE learns merges and bytes."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        n = rng.randint(5, 25)
        words = [rng.choice(WORDS) for _ in range(n)]
        if i % 7 == 0:
            words.append(str(rng.randint(0, 99999)))
        line = " ".join(words).capitalize() + rng.choice([".", "!", "?", ",", ";"])
        out.append(line)
    return out


def build(out_dir: Path, seed: int, vocab_size: int) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    random.seed(seed)
    torch.manual_seed(seed)

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<unk>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=1024,
    )

    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=1024,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.eval()

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    fast.save_pretrained(out_dir)
    (out_dir / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": config.bos_token_id,
                "eos_token_id": config.eos_token_id,
                "do_sample": False,
            },
            indent=2,
        )
        + "\n"
    )
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny llama: {n_params} parameters, vocab {len(fast)}")


def main(argv: list[str] | None = None) -> int:
    default_out = os.environ.get("SD_TINY_MODEL_DIR", str(Path.home() / ".cache" / "sd-controller" / "tiny-llama"))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=default_out, help=f"output directory (default {default_out})")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--vocab-size", type=int, default=2048)
    args = parser.parse_args(argv)
    out = Path(args.out)
    # Build next to the target and rename: an interrupted build never looks finished
    # (setup-vllm.sh skips the build when config.json exists).
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp, args.seed, args.vocab_size)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"tiny model ready in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
