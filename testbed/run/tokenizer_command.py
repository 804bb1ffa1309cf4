"""`testbed tokenizer`: a small Hugging Face tokenizer written locally, for load generators that
count tokens (aiperf's `--tokenizer`) on a machine that cannot download one.

The served model (`kimi-linear-1t`) is no tokenizer anyone can fetch, and the mock nodes count a
text prompt at 4 bytes a token anyway, so a byte-level BPE trained here on the text the client
draws its prompts from (aiperf's own corpus, where aiperf is installed) counts about as the router
does. It is written into a Hugging Face cache as a named repo, not as a bare directory: aiperf 0.13
loads the tokenizer in worker processes with HF_HUB_OFFLINE forced on, and offline it resolves
names only through the cache, so `HF_HOME=OUT HF_HUB_OFFLINE=1 aiperf ... --tokenizer REPO` works in
every mode, trace replay included."""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from testbed.core.errors import UserError

EOS = "<|endoftext|>"
REPO = "prfaas-testbed/tokenizer"
# The cache's snapshot name: any 40-hex string; the refs/main file points at it.
COMMIT = "0" * 40
# About 4 bytes per token on aiperf's corpus, the router's own estimate of a text prompt's length.
VOCAB = 6000
ROOT = Path(__file__).resolve().parents[2]


def aiperf_corpus() -> list[str]:
    """The text aiperf draws its synthetic prompts from, or [] without aiperf."""
    spec = importlib.util.find_spec("aiperf")
    if spec is None or spec.origin is None:
        return []
    path = Path(spec.origin).parent / "dataset" / "generator" / "assets" / "shakespeare.txt"
    return [line.strip() for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def project_corpus() -> list[str]:
    """The project's own prose (README, trace formats, the hand-written docs) where the checkout has it:
    English with numbers and code words."""
    files = [
        ROOT / "README.md",
        ROOT / "traces/FORMATS.md",
        *sorted(p for p in (ROOT / "docs").rglob("*.md") if "results" not in p.parts),
    ]
    text = "\n".join(p.read_text() for p in files if p.is_file())
    return [line for line in text.splitlines() if line.strip()]


def byte_level_bpe(lines: Iterable[str], vocab_size: int = VOCAB) -> Any:
    """A GPT-2-style byte-level BPE (the scheme of GPT-2, tiktoken, Llama 3 and Qwen)."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as e:
        raise UserError("testbed tokenizer needs the `tokenizers` package (pip install -e '.[clients]')") from e
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(lines, trainer)
    return tok


def save_hf(tok: Any, out: Path) -> Path:
    """Write `tok` as a Hugging Face tokenizer directory (what `AutoTokenizer.from_pretrained` loads)."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 1 << 30,
                "bos_token": EOS,
                "eos_token": EOS,
                "unk_token": EOS,
                "clean_up_tokenization_spaces": False,
            }
        )
    )
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": EOS, "eos_token": EOS, "unk_token": EOS}))
    # AutoTokenizer (vllm bench serve, transformers 5) reads a model config before the tokenizer's;
    # any known model type will do, tokenizer_class above decides the class.
    (out / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    return out


def save_hf_cache(tok: Any, hf_home: Path, repo: str = REPO) -> Path:
    """Write `tok` into the Hugging Face cache under `hf_home` as `repo`; returns its snapshot directory."""
    owner, name = repo.split("/")
    base = hf_home / "hub" / f"models--{owner}--{name}"
    (base / "refs").mkdir(parents=True, exist_ok=True)
    (base / "refs" / "main").write_text(COMMIT)
    return save_hf(tok, base / "snapshots" / COMMIT)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    c = sub.add_parser(
        "tokenizer",
        help="write a local Hugging Face tokenizer for aiperf and other clients (offline)",
        description=__doc__.split("\n\n")[0],
    )
    c.add_argument(
        "--out",
        default="build/hf",
        help="the Hugging Face home to write into (default build/hf); "
        "clients then run with HF_HOME=OUT HF_HUB_OFFLINE=1",
    )
    c.add_argument("--repo", default=REPO, help=f"the name clients pass as --tokenizer (default {REPO})")
    c.add_argument("--vocab", type=int, default=VOCAB, help=f"vocabulary size (default {VOCAB}: ~4 bytes a token)")
    c.set_defaults(func=cmd_tokenizer)


def cmd_tokenizer(args: argparse.Namespace) -> int:
    if args.repo.count("/") != 1 or not all(args.repo.split("/")):
        raise UserError(f"--repo {args.repo!r}: a Hugging Face repo name is OWNER/NAME")
    lines = aiperf_corpus() + project_corpus()
    if not lines:
        raise UserError("testbed tokenizer: no text to train on (neither aiperf's corpus nor the project's docs)")
    home = Path(args.out).resolve()
    snapshot = save_hf_cache(byte_level_bpe(lines, args.vocab), home, args.repo)
    print(f"# tokenizer {args.repo} written to {snapshot}")
    print(f"# use it with:  HF_HOME={home} HF_HUB_OFFLINE=1 aiperf profile ... --tokenizer {args.repo}")
    print(f"export HF_HOME={home} HF_HUB_OFFLINE=1")
    return 0
