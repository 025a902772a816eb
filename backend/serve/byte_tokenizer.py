"""The reference model's text vocabulary as a Hugging Face tokenizer directory, for clients that tokenize.

The model reads text as UTF-8 bytes: token id ``b`` (0-255) is the byte ``b``, and ``EOS_TOKEN``
(256) ends a generation. Clients such as AIPerf build their prompts from token ids and count tokens
with a tokenizer loaded by ``transformers.AutoTokenizer.from_pretrained(DIR)``; ``TOKENIZER_DIR``
(shipped as package data) is that tokenizer, loadable offline:

    * ``tokenizer.json``: byte-level BPE with no merges. Its vocabulary maps each byte's GPT-2
      printable character (``bytes_to_unicode``) to the byte's value, so ``encode(text) ==
      list(text.encode("utf-8"))`` for every text without the literal ``</s>``, and decoding ids
      0-255 gives those bytes as UTF-8 (invalid sequences become U+FFFD). ``</s>`` is the special
      token 256, the model's ``EOS_TOKEN``.
    * ``tokenizer_config.json``: ``PreTrainedTokenizerFast``, no BOS/EOS/pad named. A client that
      finds a BOS or EOS puts it between the blocks of a prompt it builds from hash ids (AIPerf
      does), which would put the text ``</s>`` (4 bytes to the server, 1 token to the client)
      into every prompt; with none named, a prompt of N tokens is N bytes on both sides.

``tokenizer_files()`` builds both files' contents (stdlib only); ``write_tokenizer_dir(path)``
writes them. ``python -m kvpool.backend.serve.byte_tokenizer [--out DIR]`` regenerates the shipped
directory (or writes DIR); ``--check`` exits 1 when the shipped files differ from the generated ones.

Offline, as a Hugging Face cache entry: AIPerf 0.13 loads the tokenizer again in worker processes
with ``HF_HUB_OFFLINE=1`` forced (when it builds 10 or more prompts from hash ids), and in offline
mode it resolves the name through the Hub cache, which a directory path is not.
``write_hf_cache(cache_dir)`` writes the files as the cache entry of ``HF_REPO_ID`` (revision
``main``); with ``HF_HUB_CACHE=cache_dir HF_HUB_OFFLINE=1`` in the environment, ``--tokenizer
HF_REPO_ID`` loads in every AIPerf process without the network (``--hf-cache DIR`` on the command
line).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from kvpool.backend.serve.model_config import EOS_TOKEN

#: The shipped tokenizer directory (``--tokenizer`` for AIPerf).
TOKENIZER_DIR = Path(__file__).parent / "tokenizer"

#: The name of the tokenizer's Hugging Face cache entry (``write_hf_cache``).
HF_REPO_ID = "kvpool/refmodel-bytes"

#: The text of the special token ``EOS_TOKEN``.
EOS_TEXT = "</s>"

#: Longest input the tokenizer accepts without a warning, tokens (the protocol's ``MAX_TOKENS``).
MODEL_MAX_LENGTH_TOKENS = 1 << 24

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character: the alphabet of byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def tokenizer_files() -> dict[str, dict]:
    """File name -> JSON content of the tokenizer directory (see module contract)."""
    vocab = {ch: b for b, ch in sorted(bytes_to_unicode().items())}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": EOS_TOKEN, "content": EOS_TEXT, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True},
        ],
        "normalizer": None,
        "pre_tokenizer": dict(_BYTE_LEVEL),
        "post_processor": None,
        "decoder": dict(_BYTE_LEVEL),
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": vocab, "merges": [],
        },
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MODEL_MAX_LENGTH_TOKENS,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(EOS_TOKEN): {"content": EOS_TEXT, "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": True},
        },
    }
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config}


def _text(content: dict) -> str:
    return json.dumps(content, indent=1, ensure_ascii=False, sort_keys=False) + "\n"


def write_tokenizer_dir(path: Path) -> Path:
    """Write the tokenizer files into ``path`` (created if missing); returns ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    for name, content in tokenizer_files().items():
        (path / name).write_text(_text(content), encoding="utf-8")
    return path


def write_hf_cache(cache_dir: Path, repo_id: str | None = None) -> str:
    """Write the tokenizer as the Hugging Face cache entry of ``repo_id`` (default ``HF_REPO_ID``)
    under ``cache_dir`` (an ``HF_HUB_CACHE``): ``models--ORG--NAME/refs/main`` names a snapshot
    whose revision is the SHA-1 of the files. Returns the repo id to pass as ``--tokenizer``."""
    repo_id = repo_id or HF_REPO_ID
    texts = {name: _text(content) for name, content in tokenizer_files().items()}
    revision = hashlib.sha1("".join(texts[n] for n in sorted(texts)).encode("utf-8")).hexdigest()
    entry = cache_dir / ("models--" + repo_id.replace("/", "--"))
    snapshot = entry / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (snapshot / name).write_text(text, encoding="utf-8")
    (entry / "refs").mkdir(exist_ok=True)
    (entry / "refs" / "main").write_text(revision, encoding="ascii")
    return repo_id


def stale_files(path: Path = TOKENIZER_DIR) -> list[str]:
    """Names of the tokenizer files under ``path`` that are missing or differ from ``tokenizer_files()``."""
    out = []
    for name, content in tokenizer_files().items():
        f = path / name
        if not f.is_file() or f.read_text(encoding="utf-8") != _text(content):
            out.append(name)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvpool.backend.serve.byte_tokenizer", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=TOKENIZER_DIR, help=f"directory to write (default {TOKENIZER_DIR})")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when the files under --out differ")
    ap.add_argument("--hf-cache", type=Path, metavar="DIR", help=f"write the Hugging Face cache entry {HF_REPO_ID} under DIR instead")
    args = ap.parse_args(argv)
    if args.hf_cache is not None:
        repo_id = write_hf_cache(args.hf_cache)
        print(f"HF_HUB_CACHE={args.hf_cache} HF_HUB_OFFLINE=1 aiperf profile --tokenizer {repo_id} ...")
        return 0
    if args.check:
        stale = stale_files(args.out)
        if stale:
            print(f"error: {args.out}: {', '.join(stale)} missing or out of date; "
                  "run python -m kvpool.backend.serve.byte_tokenizer", file=sys.stderr)
            return 1
        return 0
    write_tokenizer_dir(args.out)
    print(f"wrote {', '.join(tokenizer_files())} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
