"""loramcl as a user installs it: `python -m build` makes an sdist and, from it, a wheel; the wheel goes into a fresh
venv without the checkout on its path, and the commands run from an empty folder on the recipes packaged inside it.

The venv reuses this environment's installed dependencies (a `.pth` line naming this environment's site-packages,
read after the venv's own), so nothing is downloaded and the test takes seconds beyond the audio-captioning run.
This environment's own loramcl (an editable install of the checkout) is not importable there: editable installs hook
in through `.pth` files of this site-packages, which a `.pth` line does not run; the test checks where loramcl loads
from.
"""

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    """(venv folder, its `loramcl` script, the sdist, the wheel): the wheel built from the sdist, installed alone."""
    base = tmp_path_factory.mktemp("wheel")
    dist = base / "dist"
    try:
        import build  # noqa: F401  (the dev extra; `make setup` installs it)
    except ImportError:
        pytest.fail("the `build` package is missing: pip install -c constraints.txt build (it is in the dev extra)")
    # no flag: the sdist first, then the wheel from the unpacked sdist (so the sdist is shown to build and install)
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)], check=True,
                   capture_output=True, text=True, env=_clean_env())
    (sdist,), (wheel,) = sorted(dist.glob("*.tar.gz")), sorted(dist.glob("*.whl"))
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # this environment's site-packages folders (one in CI; more where this one itself chains another by a .pth line)
    (site / "ci-environment.pth").write_text("".join(f"{p}\n" for p in sys.path if p.endswith("site-packages")))
    # this pip installs into the venv (--python); --force-reinstall: it sees the checkout's loramcl 0.1.0 through
    # the .pth line and would call it already installed
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--force-reinstall", str(wheel)], check=True, capture_output=True, text=True, env=_clean_env())
    return venv, venv / "bin" / "loramcl", sdist, wheel


def _clean_env() -> dict:
    """The environment without a PYTHONPATH (tests may run with the checkout's src/ on it)."""
    return {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}


def _run(script: Path, args: list[str], cwd: Path, timeout: float = 60) -> str:
    result = subprocess.run([str(script), *args], cwd=cwd, capture_output=True, text=True, env=_clean_env(),
                            timeout=timeout)
    assert result.returncode == 0, f"loramcl {' '.join(args)}: {result.stderr[-2000:]}"
    return result.stdout


def test_the_sdist_and_the_wheel_hold_the_recipes_and_the_licence(wheel_venv):
    _, _, sdist, wheel = wheel_venv
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    recipes = sorted(p.relative_to(ROOT / "src").as_posix() for p in (ROOT / "src/loramcl/recipes").rglob("*.yaml"))
    assert len(recipes) > 40 and set(recipes) <= set(names)
    assert "loramcl-0.1.0.dist-info/licenses/LICENSE" in names
    with tarfile.open(sdist) as archive:
        members = {Path(name).relative_to(Path(name).parts[0]).as_posix() for name in archive.getnames()}
    assert {"LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml"} <= members
    assert {f"src/{name}" for name in recipes} <= members


def test_the_installed_wheel_runs_from_an_empty_folder(wheel_venv, tmp_path):
    """From an empty folder: the version, the recipe list, a command's help, the packaged tiny audio recipe end to end
    (--quick), the packaged tiny image recipe up to its data (its model built, its TextCaps-layout set written and
    read), and a copy of the audio recipe run with --recipes <copy>."""
    venv, loramcl, _, _ = wheel_venv
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import loramcl; print(loramcl.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, env=_clean_env(), check=True).stdout
    assert Path(where.strip()).is_relative_to(venv), where  # the wheel's loramcl, not the checkout's
    assert _run(loramcl, ["--version"], tmp_path).startswith("loramcl 0.1.0 (")
    listing = _run(loramcl, ["recipes"], tmp_path)
    assert "audio_captioning    tiny                CPU" in listing and f"packaged in {venv}" in listing
    assert "--preset" in _run(loramcl, ["markov", "--help"], tmp_path)

    report = _run(loramcl, ["audio-captioning", "--quick", "true", "--out", "quick"], tmp_path, timeout=600)
    assert (tmp_path / "quick" / "report.md").is_file() and "report:" in report

    # the packaged CPU image recipe's model and generated TextCaps-layout set, built and read from the empty folder
    _run(loramcl, ["image-captioning", "--quick", "true", "--out", "image", "--stop_after", "data"], tmp_path)
    assert (tmp_path / "image" / "tiny-llava-next" / "config.json").is_file()
    assert len((tmp_path / "image" / "data" / "test.jsonl").read_text().splitlines()) == 3

    copied = _run(loramcl, ["recipes", "copy", "audio_captioning/tiny", "mine"], tmp_path)
    assert copied.endswith("run it: loramcl audio-captioning --recipes mine\n")
    _run(loramcl, ["audio-captioning", "--recipes", "mine", "--quick", "true", "--out", "copy",
                   "--stop_after", "data"], tmp_path)
    assert (tmp_path / "copy" / "data").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy", "image", "mine", "quick"]  # nothing written elsewhere
