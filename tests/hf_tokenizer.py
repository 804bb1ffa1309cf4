"""Small tokenizers built at test time (nothing can be downloaded here): what load generators
count prompt and output tokens with. Trained on representative English text, in the
Hugging Face layout (`tokenizer.json` + `tokenizer_config.json`) that `AutoTokenizer` and
aiperf's `--tokenizer PATH` load."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from testbed.run import tokenizer_command as tokenizer
from testbed.run.tokenizer_command import EOS, byte_level_bpe, save_hf

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["EOS", "byte_level_bpe", "english_corpus", "save_hf", "save_hf_cache", "sentencepiece_bpe", "wordpiece"]


def english_corpus() -> list[str]:
    """The project's own prose (README, format notes and the documentation's hand-written pages):
    English with numbers and code words."""
    files = [
        ROOT / "README.md",
        ROOT / "traces/FORMATS.md",
        *sorted(p for p in (ROOT / "docs").rglob("*.md") if "results" not in p.parts),
    ]
    text = "\n".join(p.read_text() for p in files if p.exists())
    return [line for line in text.splitlines() if line.strip()]


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


CACHE_REPO = "prfaas-testbed/test-tokenizer"


def save_hf_cache(tok: Any, hf_home: Path, repo: str = CACHE_REPO) -> str:
    """Write `tok` into a Hugging Face cache under `hf_home` as repo `repo` and return the repo id
    (`testbed tokenizer` does the same for users; why a cache and not a directory: its docstring)."""
    tokenizer.save_hf_cache(tok, hf_home, repo)
    return repo
