"""Small tokenizers built at test time (nothing can be downloaded here): what load generators
count prompt and output tokens with. Trained on representative English text, in the
Hugging Face layout (`tokenizer.json` + `tokenizer_config.json`) that `AutoTokenizer` and
aiperf's `--tokenizer PATH` load."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EOS = "<|endoftext|>"


def english_corpus() -> list[str]:
    """The project's own prose (README, format notes and the documentation's hand-written pages):
    English with numbers and code words."""
    files = [ROOT / "README.md", ROOT / "traces/FORMATS.md",
             *sorted(p for p in (ROOT / "docs").rglob("*.md") if "results" not in p.parts)]
    text = "\n".join(p.read_text() for p in files if p.exists())
    return [line for line in text.splitlines() if line.strip()]


def byte_level_bpe(lines: Iterable[str], vocab_size: int = 2000) -> Any:
    """A GPT-2-style byte-level BPE (the scheme of GPT-2, tiktoken, Llama 3 and Qwen)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    return tok


def sentencepiece_bpe(lines: Iterable[str], vocab_size: int = 2000) -> Any:
    """A SentencePiece-style BPE (the scheme of Llama 2 and Mistral): spaces as a meta symbol."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", EOS], show_progress=False)
    tok.train_from_iterator(lines, trainer)
    return tok


def wordpiece(lines: Iterable[str], vocab_size: int = 2000) -> Any:
    """A BERT-style WordPiece."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=["[UNK]"], show_progress=False)
    tok.train_from_iterator(lines, trainer)
    return tok


def save_hf(tok: Any, out: Path) -> Path:
    """Write `tok` as a Hugging Face tokenizer directory; returns it."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30,
        "bos_token": EOS, "eos_token": EOS, "unk_token": EOS, "clean_up_tokenization_spaces": False,
    }))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": EOS, "eos_token": EOS, "unk_token": EOS}))
    return out


CACHE_REPO = "prfaas-testbed/test-tokenizer"
CACHE_COMMIT = "0" * 40


def save_hf_cache(tok: Any, hf_home: Path, repo: str = CACHE_REPO) -> str:
    """Write `tok` into a Hugging Face cache under `hf_home` as repo `repo` and return the repo
    id. aiperf 0.13 loads a tokenizer in worker processes with HF_HUB_OFFLINE forced on, and
    offline it resolves names only through the cache (a plain directory path fails there: it is
    not a repo id), so with `HF_HOME=hf_home HF_HUB_OFFLINE=1` `--tokenizer REPO` works in every
    mode, trace replay included."""
    owner, name = repo.split("/")
    base = hf_home / "hub" / f"models--{owner}--{name}"
    (base / "refs").mkdir(parents=True, exist_ok=True)
    (base / "refs" / "main").write_text(CACHE_COMMIT)
    save_hf(tok, base / "snapshots" / CACHE_COMMIT)
    return repo
