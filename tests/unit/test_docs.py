"""The documentation: the MkDocs site builds with ``--strict`` without Horovod, PyTorch
or TensorFlow, README.md stays short and its runnable blocks run, every relative link
resolves, and the example compressor of docs/custom-compressor.md works."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
EXAMPLE = DOCS / "examples" / "int8_compressor.py"
MAX_README_LINES = 300

#: what the docs build must not import: mkdocstrings reads the sources statically
BLOCKED = ("torch", "tensorflow", "horovod", "keras", "triton")
SITECUSTOMIZE = f"""
import sys

class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError(name + " is blocked: building the docs must not import it")
        return None

sys.meta_path.insert(0, _Blocked())
"""


def test_mkdocs_build_strict(tmp_path):
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ, PYTHONPATH=str(block), NO_MKDOCS_2_WARNING="1")
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                        "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    api = (site / "api" / "compressors" / "base" / "index.html").read_text()
    assert 'id="hvd_compress.compressors.base.Compressor.compress"' in api   # rendered
    assert (site / "_repo" / "benchmarks" / "results" / "step_time_2026-11-22.png").exists()


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines < MAX_README_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_readme_keeps_the_two_commands():
    """.ci/run and the checker read the README's commands: keep them as they are."""
    text = README.read_text()
    assert ("```bash\nmake demo   # sets everything up if needed, then trains MNIST on 2 "
            "workers with top-k (1%)\nmake test   # sets everything up if needed, then runs "
            "the whole test suite\n```") in text


def runnable_blocks():
    """The README's fenced blocks marked ```` ```bash runnable ````: cheap commands."""
    return re.findall(r"^```bash runnable\n(.*?)^```$", README.read_text(), re.M | re.S)


def test_readme_has_runnable_blocks():
    assert runnable_blocks()


@pytest.mark.parametrize("block", runnable_blocks(), ids=lambda b: b.strip()[:40])
def test_readme_runnable_block(block):
    assert not re.search(r"\bmake\b|horovodrun|torchrun|sudo", block), \
        "mark only cheap commands runnable"
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{block}\n--- exit {r.returncode}\n{r.stdout[-3000:]}{r.stderr[-3000:]}"


# --- relative links ----------------------------------------------------------------------
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def markdown_files():
    return [README] + sorted(DOCS.rglob("*.md"))


def without_fences(text):
    return re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.M | re.S)


def without_code(text):
    return re.sub(r"`[^`\n]*`", "", without_fences(text))


def slug(heading):
    """MkDocs' (Python-Markdown toc) anchor of a heading."""
    text = re.sub(r"`", "", heading).strip()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path):
    text = path.read_text()
    for inc in re.findall(r'^--8<-- "([^"]+)"', text, re.M):      # pymdownx.snippets
        text += "\n" + (ROOT / inc).read_text()
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", without_fences(text), re.M)}


def test_every_relative_link_resolves():
    bad = []
    for md in markdown_files():
        for url in LINK.findall(without_code(md.read_text())):
            if re.match(r"^[a-z][a-z0-9+.-]*:", url) or url.startswith("#"):
                continue
            path, _, anchor = url.partition("#")
            target = (md.parent / path).resolve()
            where = f"{md.relative_to(ROOT)}: {url}"
            if not target.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target):
                bad.append(f"{where} (no heading #{anchor})")
    assert not bad, "\n".join(bad)


# --- the example compressor ----------------------------------------------------------------
@pytest.fixture(scope="module")
def example():
    from hvd_compress.compressors import REGISTRY
    spec = importlib.util.spec_from_file_location("int8_compressor", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    REGISTRY.pop(module.AbsmaxInt8.name, None)     # other tests enumerate the registry


def reference(g):
    """What rank ``g`` contributes, in numpy: round(g / s) * s with s = max|g| / 127."""
    scale = np.float32(np.abs(g).max()) / np.float32(127.0)
    q = (g / scale + np.float32(127.5)).astype(np.int16) - 127
    return q.astype(np.float32) * scale, scale


class Torch:
    def __init__(self):
        import torch
        self.t = torch

    def tensor(self, a):
        return self.t.from_numpy(a)

    def numpy(self, x):
        return x.numpy()


class TF:
    def __init__(self):
        import tensorflow as tf
        self.t = tf

    def tensor(self, a):
        return self.t.constant(a)

    def numpy(self, x):
        return x.numpy()


@pytest.fixture(params=["torch", "tensorflow"], scope="module")
def fw(request):
    return Torch() if request.param == "torch" else TF()


def test_example_compressor_aggregates_through_the_in_process_exchange(example, fw):
    import hvd_compress
    from hvd_compress.exchange.in_process import run
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(5000).astype(np.float32) * (r + 1) for r in range(3)]
    ranks = [hvd_compress.from_spec("int8_example") for _ in grads]
    assert ranks[0].spec == "int8_example:ef=1" and ranks[0].collective == "allgather"
    exchanges = run(ranks, [fw.tensor(g) for g in grads], "w")
    got = [fw.numpy(e.result) for e in exchanges]
    for other in got[1:]:
        np.testing.assert_array_equal(other, got[0])             # every rank: the same sum
    parts = [reference(g) for g in grads]
    np.testing.assert_allclose(got[0], sum(p for p, _ in parts), rtol=1e-6, atol=1e-5)
    bound = sum(s for _, s in parts) / 2 * 1.001                 # half a step per rank
    assert np.abs(got[0] - sum(grads)).max() <= bound
    codes, scale = exchanges[0].payload
    assert fw.numpy(codes).dtype == np.int8 and fw.numpy(scale).shape == (1,)


def test_example_compressor_error_feedback_conserves_the_gradients(example, fw):
    import hvd_compress
    from hvd_compress.exchange.in_process import run
    rng = np.random.default_rng(1)
    ranks = [hvd_compress.from_spec("int8_example") for _ in range(2)]
    sent, total = 0, 0
    for _ in range(4):
        grads = [rng.standard_normal(777).astype(np.float32) for _ in ranks]
        sent = sent + fw.numpy(run(ranks, [fw.tensor(g) for g in grads], "w")[0].result)
        total = total + sum(grads)
    residuals = sum(fw.numpy(c.residual("w")) for c in ranks)
    np.testing.assert_allclose(sent + residuals, total, atol=1e-4)


def test_custom_compressor_page_shows_the_example_as_it_is():
    page = (DOCS / "custom-compressor.md").read_text()
    assert "```python\n" + EXAMPLE.read_text().rstrip("\n") + "\n```" in page
