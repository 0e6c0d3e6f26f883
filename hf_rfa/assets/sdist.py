"""Files read out of a pinned source archive (sdist) on a package index: nothing in it runs.

A few assets ship only in packages that PyPI has no wheel of (``openai-whisper``: the GPT-2
tokenizer ranks). Installing such a package runs its ``setup.py``; instead the set-up step
(``python -m hf_rfa.assets``) fetches the ``.tar.gz`` itself from the simple index of the package
indexes pip is configured with (``pip config list``; default ``https://pypi.org/simple``), refuses
it unless its sha256 is the pinned one, and copies out only the named members with
:mod:`tarfile` (an archive with an absolute, ``..``, or outside-pointing link member is refused
as a whole; members are read as bytes and written to paths of our own choosing, never
extracted by name). Each member is checked against its own pinned sha256 and cached in
``$HF_RFA_CACHE/sdist/<project>-<version>/<member>``; library calls only read that cache and
raise :class:`~hf_rfa.assets.store.AssetNotPrepared` when it is missing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .store import _INSTALL, _TMP_PREFIX, PREPARE_COMMAND, AssetNotPrepared, cache_dir

logger = logging.getLogger(__name__)

#: the index pip uses when none is configured
DEFAULT_INDEX = "https://pypi.org/simple"
#: largest archive / member read (bytes): a bound on what a wrong index can make us hold
MAX_BYTES = 256 * 2**20
_CHUNK = 2**20


@dataclass(frozen=True)
class Sdist:
    """One pinned source archive: ``project`` and ``version`` on the index, the archive's
    ``filename`` and ``sha256``, and ``members``: ``{path inside the archive's top folder:
    sha256}`` of the files taken from it."""

    project: str
    version: str
    filename: str
    sha256: str
    members: dict[str, str]

    @property
    def top(self) -> str:
        """The archive's top folder (``<name>-<version>``, the file name without ``.tar.gz``)."""
        return self.filename.removesuffix(".tar.gz")

    def cached(self, member: str) -> Path:
        """Where ``member`` is cached once prepared."""
        return cache_dir() / "sdist" / f"{self.project}-{self.version}" / member


def sha256_of(path: Path) -> str:
    """Hex sha256 of the file at ``path``."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def verify_sha256(path: Path, expected: str) -> None:
    """ValueError unless the file at ``path`` has sha256 ``expected`` (the archive is refused)."""
    got = sha256_of(path)
    if got != expected.lower():
        raise ValueError(f"{path.name}: sha256 {got} is not the pinned {expected}; refused")


def _unsafe_name(name: str) -> bool:
    """An archive path that would leave the extraction folder: absolute, with a ``..`` part, a
    drive letter or a backslash."""
    p = PurePosixPath(name)
    return p.is_absolute() or ".." in p.parts or "\\" in name or re.match(r"^[A-Za-z]:", name) is not None


def check_members(tar: tarfile.TarFile) -> None:
    """ValueError naming the first unsafe member of ``tar``: an unsafe path, a link whose target
    is absolute or has ``..``, or anything but a file, folder or link (devices, FIFOs)."""
    for m in tar.getmembers():
        if _unsafe_name(m.name):
            raise ValueError(f"archive member {m.name!r} has an absolute or '..' path; archive refused")
        if (m.issym() or m.islnk()) and _unsafe_name(m.linkname):
            raise ValueError(f"archive member {m.name!r} links to {m.linkname!r} (absolute or '..'); archive refused")
        if not (m.isfile() or m.isdir() or m.issym() or m.islnk()):
            raise ValueError(f"archive member {m.name!r} is not a regular file or folder; archive refused")


def read_members(archive: Path, sdist: Sdist) -> dict[str, bytes]:
    """The bytes of every member of ``sdist`` from the verified ``archive``.

    Raises ValueError: wrong archive sha256, an unsafe member anywhere in the archive, a member
    missing, not a regular file, larger than :data:`MAX_BYTES` or with the wrong sha256.
    """
    verify_sha256(archive, sdist.sha256)
    out: dict[str, bytes] = {}
    with tarfile.open(archive, "r:gz") as tar:
        check_members(tar)
        for member, digest in sdist.members.items():
            name = f"{sdist.top}/{member}"
            try:
                info = tar.getmember(name)
            except KeyError:
                raise ValueError(f"{archive.name} has no member {name!r}") from None
            if not info.isfile() or info.size > MAX_BYTES:
                raise ValueError(f"{archive.name}: {name!r} is not a regular file of at most {MAX_BYTES} bytes")
            data = tar.extractfile(info).read()
            got = hashlib.sha256(data).hexdigest()
            if got != digest.lower():
                raise ValueError(f"{archive.name}: {name!r} has sha256 {got}, not the pinned {digest}; refused")
            out[member] = data
    return out


# --------------------------------------------------------------------------------------------
# The package index (the set-up step only)
# --------------------------------------------------------------------------------------------


def index_urls(pip_config: str, env: dict[str, str] | None = None) -> list[str]:
    """Index URLs in pip's order: ``index-url`` (default :data:`DEFAULT_INDEX`), then every
    ``extra-index-url``, from ``pip config list`` output (``section.key='value'`` lines) and the
    ``PIP_INDEX_URL`` / ``PIP_EXTRA_INDEX_URL`` variables of ``env`` (which win)."""
    main, extra = None, []
    for line in pip_config.splitlines():
        m = re.match(r"^\s*[^.=]*\.(index-url|extra-index-url)\s*=\s*'?(.*?)'?\s*$", line)
        if m:
            if m.group(1) == "index-url":
                main = m.group(2).strip()
            else:
                extra += m.group(2).split()
    env = os.environ if env is None else env
    main = env.get("PIP_INDEX_URL") or main or DEFAULT_INDEX
    extra = env["PIP_EXTRA_INDEX_URL"].split() if env.get("PIP_EXTRA_INDEX_URL") else extra
    return list(dict.fromkeys([main, *extra]))


def _pip_index_urls() -> list[str]:
    """:func:`index_urls` of this interpreter's pip configuration."""
    try:
        cfg = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        logger.warning("pip config list failed (%s): using %s", e, DEFAULT_INDEX)
        cfg = ""
    return index_urls(cfg)


def _normalize(project: str) -> str:
    return re.sub(r"[-_.]+", "-", project).lower()


def _open(url: str, accept: str | None = None):
    """A readable response for ``url`` (http(s) or file; a file: folder reads its index.html)."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        path = Path(urllib.request.url2pathname(parsed.path))
        return open(path / "index.html" if path.is_dir() else path, "rb")
    if parsed.scheme not in ("http", "https"):
        raise ValueError(f"index URL {url!r}: only http, https and file URLs are read")
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    return urllib.request.urlopen(req, timeout=120)  # noqa: S310 (scheme checked above)


def find_links(page: bytes, page_url: str) -> dict[str, tuple[str, str | None]]:
    """``{file name: (absolute URL, sha256 or None)}`` of a simple-index project page, in the
    JSON form (PEP 691) or the HTML form (PEP 503, hash in a ``#sha256=`` fragment)."""
    links: dict[str, tuple[str, str | None]] = {}
    text = page.decode("utf-8", errors="replace")
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("files"), list):
        for f in doc["files"]:
            if isinstance(f, dict) and "filename" in f and "url" in f:
                links[f["filename"]] = (urllib.parse.urljoin(page_url, f["url"]), (f.get("hashes") or {}).get("sha256"))
        return links
    for href in re.findall(r"""<a\s[^>]*href\s*=\s*["']([^"']+)["']""", text, flags=re.I):
        url = urllib.parse.urljoin(page_url, href.replace("&amp;", "&"))
        base, _, frag = url.partition("#")
        digest = frag.split("=", 1)[1] if frag.startswith("sha256=") else None
        links[urllib.parse.unquote(base.rsplit("/", 1)[-1])] = (base, digest)
    return links


def download(sdist: Sdist, dest: Path, indexes: list[str]) -> Path:
    """Fetch ``sdist.filename`` from the first index that lists it into folder ``dest``; verified
    (ValueError on a wrong sha256); ``FileNotFoundError`` when no index has it."""
    tried = []
    for index in indexes:
        page_url = index.rstrip("/") + f"/{_normalize(sdist.project)}/"
        try:
            with _open(page_url, "application/vnd.pypi.simple.v1+json, text/html;q=0.1") as r:
                links = find_links(r.read(MAX_BYTES), page_url)
        except OSError as e:  # (URLError and HTTPError are OSErrors) this index does not have it
            tried.append(f"{page_url} ({e})")
            continue
        if sdist.filename not in links:
            tried.append(f"{page_url} (no {sdist.filename})")
            continue
        url, listed = links[sdist.filename]
        if listed is not None and listed.lower() != sdist.sha256:
            raise ValueError(f"{page_url} lists {sdist.filename} with sha256 {listed}, not the pinned {sdist.sha256}; refused")
        path = dest / sdist.filename
        logger.info("downloading %s (sha256 pinned; nothing in it is run)", url)
        size = 0
        with _open(url) as r, open(path, "wb") as f:
            for block in iter(lambda: r.read(_CHUNK), b""):
                size += len(block)
                if size > MAX_BYTES:
                    raise ValueError(f"{url}: larger than {MAX_BYTES} bytes; refused")
                f.write(block)
        verify_sha256(path, sdist.sha256)
        return path
    raise FileNotFoundError(f"{sdist.filename} found on no package index: " + "; ".join(tried))


def sdist_file(sdist: Sdist, member: str, indexes: list[str] | None = None) -> Path:
    """The cached, verified ``member`` of ``sdist`` (a key of ``sdist.members``).

    Prepared inside :func:`~hf_rfa.assets.store.installing` (the set-up step): the archive is
    downloaded (``indexes``; default pip's configured ones), verified and read, every member of
    ``sdist`` written atomically to the cache, and the archive deleted. Anywhere else a missing
    member raises :class:`AssetNotPrepared` naming the set-up command.
    """
    if member not in sdist.members:
        raise ValueError(f"member must be one of {sorted(sdist.members)}, got {member!r}")
    path = sdist.cached(member)
    if path.is_file():
        verify_sha256(path, sdist.members[member])
        return path
    if not _INSTALL["allowed"]:
        raise AssetNotPrepared(
            f"{member} from the source archive {sdist.filename} ({sdist.project}=={sdist.version}) is not prepared; "
            f"prepare the offline assets once with `{PREPARE_COMMAND}` (scripts/setup.sh runs it)"
        )
    folder = sdist.cached(member).parent
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=_TMP_PREFIX + "sdist.", dir=folder) as tmp:
        archive = download(sdist, Path(tmp), _pip_index_urls() if indexes is None else indexes)
        for name, data in read_members(archive, sdist).items():
            target = sdist.cached(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, part = tempfile.mkstemp(prefix=_TMP_PREFIX + target.name + ".", dir=target.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.chmod(part, 0o644)
                os.replace(part, target)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(part)
                raise
    return path
