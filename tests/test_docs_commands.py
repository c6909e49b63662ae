"""Every command written in README.md and docs/ is checked, so that a renamed flag, a removed option, a moved
import or a missing script fails here instead of in a reader's terminal.

How: each fenced shell block (and each unlabelled block that starts with a command) is split into shell
statements, its synopsis notation filled in (`[--opt X]` -> `--opt X`, `a|b` -> `a`, `...` dropped, `DIR`, `N`,
`FILE` ... -> a representative value), and run by bash in a sandbox copy of the repository in which `sparserl`,
`python`, `bash`, `pip`, `pytest` and `ray` are stand-ins that record how they were called. So bash itself
expands the loops, variables, functions and `&`/`wait`, and a documented shell script runs (dry) and has its
own commands recorded. Then every recorded call is checked:

- `sparserl ...` (or `python -m sparserl.cli ...`): parsed by the CLI's own parser, built as `main` builds it, and
  run by its own handler up to where the job would start (the model load, the trainer, the output directory),
  which is replaced by a stand-in: so its config (`--config` files relative to the documented directory, flags
  as overrides) is validated and nothing trains;
- `python path/to/script.py ...`: the file exists; in a subprocess, a script with a main guard is imported (its
  top level runs, `main` does not) and, if it uses argparse, its own parser parses the documented arguments; a
  script without a main guard, whose top level is the job, has only its import statements executed; every
  `sparserl` import anywhere in a script is executed too;
- `bash path/to/script.sh`: the file exists, passes `bash -n` and its dry run exits 0;
- anything else fails, unless it is on SKIPPED below with the reason.

The slow test runs the documented commands that take seconds, and `--help` of every documented command.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The README, every page under docs/ and docs/results/ (the study pages; a new page is checked without being listed)
# and bench/README.md.
DOCUMENTS = ("README.md", *(path.relative_to(ROOT).as_posix() for folder in ("docs", "docs/results")
                           for path in sorted((ROOT / folder).glob("*.md"))), "bench/README.md")
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
# An unlabelled block is a command block when its first line starts with one of these (else it is output).
COMMAND_WORDS = {"sparserl", "python", "python3", "bash", "cd", "pip", "ray"}
STAND_INS = ("sparserl", "python", "python3", "bash", "pip", "pip3", "pytest", "ray")
BASH = shutil.which("bash")  # the real one: inside the sandbox `bash` is a stand-in
SANDBOX_DIRS = ("bench", "configs", "docs")  # what the documented commands and scripts read or cd into
# Documented commands not checked here, and why (by program, or by `python -m MODULE`).
SKIPPED = {
    "pip": "installs packages (network; changes the environment); tests/test_readme.py checks the README's set-up",
    "pip3": "installs packages (network; changes the environment)",
    "pytest": "the test suite itself; tests/test_readme.py checks the README's line is the one CI runs",
    "ray": "starts or joins a Ray cluster; the sparserl command beside it is checked on its own",
    "-m venv": "creates the virtual environment of the README's set-up lines (tests/test_readme.py)",
}
# Synopsis placeholders and the value that stands for each: after a given flag, or anywhere.
PLACEHOLDERS = {("--config", "FILE"): "configs/example.yaml", "FILE": "/tmp/sparserl-docs-check.json",
                "FILE.json": "/tmp/sparserl-docs-check.json", "DIR": "runs/docs-check", "N": "2",
                "MODE": "sparse-rl", "S": "0", "B": "56"}
# What each command's handler calls to start its job, replaced by a stand-in that stops there: everything the
# handler parses and validates before it runs; nothing is loaded, trained or written.
JOB_STARTS = {
    "train": ("sparserl.train.trainer", "GRPOTrainer"),
    "eval": ("sparserl.experiments.eval", "held_out"),
    "sweep": ("sparserl.experiments.sweep", "held_out"),
    "audit": ("sparserl.experiments.audit", "held_out"),
    "calibrate": ("sparserl.experiments.calibrate", "held_out"),
    "compare": ("sparserl.experiments.compare", "make_output_dir"),
    "warmup": ("sparserl.experiments.warmup", "warmup"),
    "sft": ("sparserl.experiments.sft", "sft"),
    "model": ("sparserl.model.loading", "fetch_pretrained"),
    "presets": None,  # prints a table from the code: runs as it is
}
CHEAP_SPARSERL = {"presets"}  # documented sparserl commands that finish in seconds: the slow test runs them
CHEAP_SCRIPTS = {"bench/predict_gpu.py"}  # likewise for scripts (a cost model's arithmetic, about 6 s)

STAND_IN = r"""#!{bash}
# Stands in for a documented program: records how it was called instead of running it. A shell script given
# to bash runs (dry, with these stand-ins on its PATH) and its exit status is recorded.
program=${{0##*/}}
record() {{  # program, directory, the script it runs in, exit status, argument count, arguments
  printf '%s\0' "$program" "$PWD" "${{DOCS_CHECK_SCRIPT-}}" "$1" "$(($# - 1))" "${{@:2}}" >> "$DOCS_CHECK_LOG"
}}
if [ "$program" = bash ]; then
  DOCS_CHECK_SCRIPT="$1" {bash} -O nullglob "$@"
  status=$?
  record "$status" "$@"
  exit "$status"
fi
record "" "$@"
"""


class JobReached(Exception):
    """Raised by a stand-in where a command's job would start: everything before it passed."""


@dataclass
class Statement:
    origin: str  # "README.md:41"
    text: str  # as bash receives it, synopsis notation filled in


@dataclass
class Call:
    """One recorded call of a stand-in."""

    origins: list[str]  # where it is written ("README.md:41", or "... > docs/results/x.sh" inside a script)
    program: str
    args: tuple[str, ...]
    cwd: Path  # in the repository
    status: str  # a script's exit status under bash; empty otherwise


@dataclass
class Trace:
    calls: list[Call] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------- reading the documents
def fill_synopsis(line: str) -> str:
    """A synopsis line as a runnable one: optional parts included, the first of `a|b|c`, `...` dropped, and
    placeholders replaced by PLACEHOLDERS' values."""
    line = re.sub(r"(?<!\S)\[+", "", line)
    line = re.sub(r"\]+(?!\S)", "", line)
    line = re.sub(r"(?<!\S)([\w.,-]+)(?:\|[\w.,-]+)+(?!\S)", r"\1", line)
    line = re.sub(r",\.\.\.(?!\S)|(?<!\S)\.\.\.(?!\S)", "", line)

    def placeholder(match: re.Match) -> str:
        flag, name = match.group(1), match.group(2)
        value = PLACEHOLDERS.get((flag, name), PLACEHOLDERS.get(name, name))
        return f"{flag} {value}" if flag else value

    return re.sub(r"(?:(--[\w-]+) +)?(?<!\S)([A-Z][A-Z_]*(?:\.json)?)(?!\S)", placeholder, line).rstrip()


def command_blocks(document: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each fenced block that holds shell commands."""
    blocks, lines, opened = [], [], None
    for number, line in enumerate((ROOT / document).read_text().splitlines(), 1):
        fence = re.match(r"^```\s*([\w-]*)\s*$", line)
        if fence and opened is None:
            opened, language, lines = number + 1, fence.group(1), []
        elif fence:
            first = next((w for w in " ".join(lines).split() if "=" not in w), "")
            if language in SHELL_LANGUAGES or (not language and (first in COMMAND_WORDS or "/bin/" in first)):
                blocks.append((opened, lines))
            opened = None
        elif opened is not None:
            lines.append(line)
    return blocks


def is_complete(text: str) -> bool:
    """Whether bash reads `text` as whole statements (a `for` without its `done` is not)."""
    if text.rstrip().endswith("\\"):
        return False
    return subprocess.run([BASH, "-n"], input=text, text=True, capture_output=True).returncode == 0


def documented_statements(document: str) -> list[Statement]:
    statements = []
    for first, lines in command_blocks(document):
        pending, start = [], None
        for offset, line in enumerate(lines):
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            start = first + offset if not pending else start
            pending.append(fill_synopsis(line))
            if is_complete("\n".join(pending)):
                statements.append(Statement(f"{document}:{start}", "\n".join(pending)))
                pending = []
        if pending:
            statements.append(Statement(f"{document}:{start}", "\n".join(pending)))  # bash reports the error
    return statements


# ---------------------------------------------------------------------------------- running them dry
def make_sandbox(root: Path) -> dict[str, str]:
    """A copy of what the commands read, with stand-ins on PATH and in .venv/bin; the environment to run in."""
    for name in SANDBOX_DIRS:
        shutil.copytree(ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    stand_ins = root / ".stand-ins"
    stand_ins.mkdir()
    script = stand_ins / "stand-in"
    script.write_text(STAND_IN.format(bash=BASH))
    script.chmod(0o755)
    (root / ".venv" / "bin").mkdir(parents=True)
    for name in STAND_INS:
        (stand_ins / name).symlink_to(script)
        (root / ".venv" / "bin" / name).symlink_to(script)
    # A clean environment: a variable of the caller's (OUT, MODEL) must not change what a script does.
    return {"PATH": f"{stand_ins}:/usr/bin:/bin", "HOME": str(root), "LANG": "C.UTF-8",
            "DOCS_CHECK_LOG": str(root / ".calls")}


def read_calls(log: Path, sandbox: Path, origin: str) -> list[Call]:
    fields = log.read_bytes().decode().split("\0")[:-1] if log.exists() else []
    calls = []
    while fields:
        program, cwd, script, status, count = fields[:5]
        args, fields = tuple(fields[5:5 + int(count)]), fields[5 + int(count):]
        where = Path(cwd).resolve()
        inside = ROOT / where.relative_to(sandbox.resolve()) if where.is_relative_to(sandbox.resolve()) else where
        calls.append(Call([f"{origin} > {script}" if script else origin], program, args, inside, status))
    return calls


def trace_documents(sandbox: Path) -> Trace:
    env, trace = make_sandbox(sandbox), Trace()
    log = Path(env["DOCS_CHECK_LOG"])
    seen: dict[tuple, Call] = {}
    for document in DOCUMENTS:
        statements = documented_statements(document)
        if not statements:
            trace.notes.append(f"{document}: no shell commands")
        for statement in statements:
            log.unlink(missing_ok=True)
            run = subprocess.run([BASH, "-O", "nullglob", "-c", statement.text], cwd=sandbox, env=env,
                                 capture_output=True, text=True, timeout=120)
            failed = run.returncode or run.stderr.strip()
            if failed:
                trace.problems.append(f"{statement.origin}: the shell failed (exit {run.returncode}): "
                                      f"{run.stderr.strip() or statement.text}")
            calls = read_calls(log, sandbox, statement.origin)
            if not calls and not failed:
                trace.notes.append(f"{statement.origin}: ran in the sandbox, calls no program to check: "
                                   f"{statement.text!r}")
            for call in calls:
                key = (call.program, call.args, call.cwd)
                if key in seen:
                    seen[key].origins += call.origins
                else:
                    seen[key] = call
                    trace.calls.append(call)
    return trace


def classify(call: Call) -> tuple[str, tuple[str, ...]]:
    """(kind, arguments): kind is sparserl, script, shell, skip:<reason> or unknown:<why>."""
    program, args = Path(call.program).name, call.args
    if program == "sparserl":
        return "sparserl", args
    if program in ("python", "python3"):
        if args[:2] == ("-m", "sparserl.cli"):
            return "sparserl", args[2:]
        if args[:1] == ("-m",):
            reason = SKIPPED.get(f"-m {args[1]}") if len(args) > 1 else None
            return (f"skip:{reason}", args) if reason else ("unknown:a module this file does not check", args)
        if args and args[0].endswith(".py"):
            return "script", args
        return "unknown:python without a script file (stdin or -c) cannot be checked", args
    if program == "bash":
        return ("shell", args) if args and args[0].endswith(".sh") else ("unknown:bash without a script", args)
    if program in SKIPPED:
        return f"skip:{SKIPPED[program]}", args
    return "unknown:no check for this program", args


# ---------------------------------------------------------------------------------- the checks
def check_sparserl(args: tuple[str, ...], cwd: Path) -> str | None:
    """None when `sparserl ARGS`, run in `cwd`, parses and its handler gets as far as starting its job;
    else the one-line error a user would see."""
    import importlib

    from sparserl import cli
    from sparserl.errors import UserError

    chosen = next((a for a in args if not a.startswith("-")), None)
    parser = _parser(chosen if chosen in cli.COMMANDS else None)
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed), contextlib.redirect_stdout(io.StringIO()):
        try:
            parsed = parser.parse_args(list(args))
        except SystemExit as exit:
            return None if exit.code == 0 else printed.getvalue().strip().splitlines()[-1]
    if parsed.command not in JOB_STARTS:
        return f"no stand-in for `sparserl {parsed.command}`: add where its job starts to JOB_STARTS"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        if JOB_STARTS[parsed.command]:
            module, name = JOB_STARTS[parsed.command]
            patch.setattr(importlib.import_module(module), name, _stop_at_job)
        if parsed.command == "compare":  # the modes after the first are built only once their runs start
            compare = importlib.import_module("sparserl.experiments.compare")
            patch.setattr(compare, "run_compare", _compare_every_mode(compare.run_compare))
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                parsed.handler(parsed)
        except JobReached:
            return None
        except UserError as error:
            return f"sparserl: error: {error}"
        except Exception as error:  # a bug, not a user error: say which
            return f"{type(error).__name__}: {error}"
    return "the handler returned before reaching its job" if JOB_STARTS[parsed.command] else None


@functools.cache
def _parser(chosen: str | None):
    """The parser `main` builds for `sparserl CHOSEN ...` (building one reads the config's help: 0.1 s)."""
    from sparserl import cli

    return cli._build_parser(chosen)[0]


def _stop_at_job(*args, **kwargs):
    raise JobReached


def _compare_every_mode(run_compare):
    def checked(config_for_mode, modes, seeds):
        for mode in modes:
            config_for_mode(mode)
        return run_compare(config_for_mode, modes, seeds)
    return checked


def start_probe(requests: list[dict]) -> subprocess.Popen:
    """`probe_one` on each {path, args, cwd}, in one fresh interpreter (torch is imported once), in the
    background: it runs while the sparserl commands are checked."""
    probe = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    probe.stdin.write(json.dumps(requests))
    probe.stdin.close()
    return probe


def probe_results(probe: subprocess.Popen) -> list[dict]:
    out, err = probe.stdout.read(), probe.stderr.read()
    assert probe.wait(timeout=300) == 0, f"the script probe itself failed:\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


def probe_one(path: Path, args: list[str], cwd: Path) -> tuple[str, str | None]:
    """(how the script was checked, the error or None). Runs inside the probe's own interpreter."""
    import runpy

    tree = ast.parse(path.read_text(), str(path))
    guarded = any(isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) for node in tree.body)
    uses_argparse = "ArgumentParser" in ast.unparse(tree)
    ours = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
            and any(name.startswith("sparserl") for name in _imported_modules(node))]
    top_level = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    os.chdir(cwd)
    sys.path.insert(0, str(path.parent))
    sys.argv = [str(path), *args]
    printed, how = io.StringIO(), "import"
    try:
        with contextlib.redirect_stderr(printed), contextlib.redirect_stdout(io.StringIO()):
            if guarded:
                how = "imported as a module (top level run, main not)"
                namespace = runpy.run_path(str(path), run_name="docs_check")
            else:
                how = "import statements executed (no main guard: its top level is the job)"
                namespace = {}
                exec(compile(ast.Module(top_level, []), str(path), "exec"), namespace)
            exec(compile(ast.Module(ours, []), str(path), "exec"), {})
            if uses_argparse and callable(namespace.get("parse_args")):
                how += "; documented arguments parsed by its parse_args"
                namespace["parse_args"](list(args))
            elif uses_argparse and callable(namespace.get("main")):
                how += "; documented arguments parsed by its main's parser"
                _parse_then_stop(namespace["main"])
            elif uses_argparse:
                how += "; arguments not checked (neither parse_args nor main to call)"
        return how, None
    except SystemExit as exit:
        lines = printed.getvalue().strip().splitlines()
        return how, (lines[-1] if lines else f"exited {exit.code}") if exit.code else None
    except Exception as error:
        return how, f"{type(error).__name__}: {error}"
    finally:
        sys.path.remove(str(path.parent))
        for name, module in list(sys.modules.items()):  # a sibling module (bench/common.py) is per directory
            if Path(getattr(module, "__file__", None) or "/").parent == path.parent:
                del sys.modules[name]


def _imported_modules(node: ast.Import | ast.ImportFrom) -> list[str]:
    return [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]


def _parse_then_stop(main) -> None:
    """Call a script's `main()`, stopping right after its argparse parser has parsed sys.argv."""
    import argparse

    parse = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, *args, **kwargs):
        parse(self, *args, **kwargs)
        raise JobReached

    argparse.ArgumentParser.parse_args = parse_and_stop
    try:
        main()
    except JobReached:
        return
    finally:
        argparse.ArgumentParser.parse_args = parse
    raise AssertionError("main() returned without parsing arguments")


def _probe_main() -> None:
    results = []
    for request in json.loads(sys.stdin.read()):
        how, error = probe_one(Path(request["path"]), request["args"], Path(request["cwd"]))
        results.append({**request, "how": how, "error": error})
    print(json.dumps(results))


# ---------------------------------------------------------------------------------- tests
# Canaries for the script probe: it must catch a moved import (the gemma_mismatch.py defect) and a removed flag.
CANARIES = {"moved_import.py": ("import sys\nfrom sparserl.learner.alpha import bin_tails\nprint(sys.argv)\n", []),
            "removed_flag.py": ("import argparse\n\ndef main():\n    p = argparse.ArgumentParser()\n"
                                "    p.add_argument('--steps')\n    p.parse_args()\n\nif __name__ == '__main__':\n"
                                "    main()\n", ["--no-such-flag"])}


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Trace:
    return trace_documents(tmp_path_factory.mktemp("docs-sandbox"))


@pytest.fixture(scope="module")
def script_probe(trace, tmp_path_factory):
    """The documented scripts' probe, then the canaries', running in the background."""
    canaries = tmp_path_factory.mktemp("canaries")
    for name, (source, _) in CANARIES.items():
        (canaries / name).write_text(source)
    probe = start_probe(script_requests(trace) + [
        {"path": str(canaries / name), "args": args, "cwd": str(canaries), "origin": "canary"}
        for name, (_, args) in CANARIES.items()])
    yield probe
    if probe.poll() is None:
        probe.kill()


def script_requests(trace: Trace) -> list[dict]:
    requests = []
    for call in trace.calls:
        kind, args = classify(call)
        if kind == "script":
            path = (call.cwd / args[0]).resolve()
            requests.append({"path": str(path), "args": list(args[1:]), "cwd": str(call.cwd),
                             "origin": ", ".join(call.origins)})
    return requests


def test_every_documented_statement_runs_in_the_sandbox_and_each_call_has_a_check(trace, script_probe):
    # script_probe: started here, so that the scripts are probed while the next tests run.
    problems = list(trace.problems)
    for call in trace.calls:
        kind, _ = classify(call)
        if kind.startswith("unknown:"):
            problems.append(f"{call.origins[0]}: {call.program} {' '.join(call.args)}: {kind[len('unknown:'):]}; "
                            "check it here or add it to SKIPPED with the reason")
        elif kind.startswith("skip:"):
            print(f"not checked: {call.origins[0]}: {call.program} {' '.join(call.args)} ({kind[len('skip:'):]})")
    for note in trace.notes:
        print(note)
    assert sum(classify(c)[0] == "sparserl" for c in trace.calls) >= 30, "the documents' commands were not found"
    assert not problems, "\n".join(problems)


def test_documented_sparserl_commands_parse_and_validate(trace):
    problems, checked = [], 0
    for call in trace.calls:
        kind, args = classify(call)
        if kind == "sparserl":
            checked += 1
            error = check_sparserl(args, call.cwd)
            if error:
                problems.append(f"{', '.join(call.origins)}: sparserl {' '.join(args)}\n    -> {error}")
    print(f"{checked} distinct sparserl commands checked")
    assert not problems, "\n".join(problems)


def test_documented_shell_scripts_pass_bash_n_and_run_dry(trace):
    problems, scripts = [], 0
    for call in trace.calls:
        kind, args = classify(call)
        if kind != "shell":
            continue
        scripts += 1
        path = call.cwd / args[0]
        syntax = subprocess.run([BASH, "-n", str(path)], capture_output=True, text=True)
        if not path.is_file():
            problems.append(f"{call.origins[0]}: {args[0]} does not exist")
        elif syntax.returncode:
            problems.append(f"{call.origins[0]}: bash -n {args[0]}: {syntax.stderr.strip()}")
        elif call.status != "0":
            problems.append(f"{call.origins[0]}: {args[0]} exited {call.status} in its dry run")
        inside = sum(any(o.endswith(f"> {args[0]}") for o in c.origins) for c in trace.calls)
        print(f"{call.origins[0]}: {args[0]}: bash -n, dry run exit {call.status}, {inside} distinct calls inside")
    assert scripts >= 3, "the documented shell scripts were not found"
    assert not problems, "\n".join(problems)


def test_documented_python_scripts_exist_and_import(trace, script_probe):
    requests = script_requests(trace)
    missing = [f"{r['origin']}: {r['path']} does not exist" for r in requests if not Path(r["path"]).is_file()]
    assert not missing, "\n".join(missing)
    results = probe_results(script_probe)
    documented, (moved, flag) = results[:-len(CANARIES)], results[-len(CANARIES):]
    assert "ImportError" in (moved["error"] or "") and "bin_tails" in moved["error"], moved
    assert "unrecognized arguments: --no-such-flag" in (flag["error"] or ""), flag
    for result in documented:
        print(f"{result['origin']}: {Path(result['path']).relative_to(ROOT)}: {result['how']}")
    problems = [f"{r['origin']}: python {Path(r['path']).relative_to(ROOT)} {' '.join(r['args'])}\n    -> "
                f"{r['error']} ({r['how']})" for r in documented if r["error"]]
    assert len(documented) >= 10, "the documented scripts were not found"
    assert not problems, "\n".join(problems)


def test_the_checker_refuses_bad_sparserl_commands():
    cases = {("train", "--no-such-flag", "1"): "unrecognized arguments",
             ("train", "--kv-budget", "many"): "kv_budget",
             ("compare", "--config", "configs/missing.yaml"): "does not exist",
             ("compare", "--modes", "dense,no-such-mode"): "no-such-mode",
             ("sweep", "--out", "x.json", "--budgets", "24,x"): "budgets"}
    for args, expected in cases.items():
        error = check_sparserl(args, ROOT)
        assert error is not None and expected in error, (args, error)
    assert check_sparserl(("train", "--config", "configs/paper-regime.yaml", "--steps", "3"), ROOT) is None
    assert fill_synopsis("sparserl eval --out FILE.json [--n N] [--inference dense|sparse|both] [--kv-budget B ...]") \
        == "sparserl eval --out /tmp/sparserl-docs-check.json --n 2 --inference dense --kv-budget 56"


@pytest.mark.slow
def test_cheap_documented_commands_run_and_every_documented_command_answers_help(trace):
    """Runs for real: the documented commands that take seconds, and `--help` of every documented command."""
    runs: dict[tuple, Path] = {}
    for call in trace.calls:
        kind, args = classify(call)
        if kind == "sparserl":
            command = next((a for a in args if not a.startswith("-")), None)
            runs[("-m", "sparserl.cli", command, "--help")] = ROOT
            if command in CHEAP_SPARSERL:
                runs[("-m", "sparserl.cli", *args)] = call.cwd
        elif kind == "script":
            script = (call.cwd / args[0]).resolve().relative_to(ROOT).as_posix()
            if "ArgumentParser" in (ROOT / script).read_text():
                runs[(args[0], "--help")] = call.cwd
            if script in CHEAP_SCRIPTS:
                runs[args] = call.cwd
    assert any("presets" in argv for argv in runs) and any("--help" in argv for argv in runs)
    failures = []
    for argv, cwd in runs.items():
        run = subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        print(f"exit {run.returncode}: python {' '.join(argv)}")
        if run.returncode:
            failures.append(f"python {' '.join(argv)} (in {cwd}): exit {run.returncode}\n{run.stderr[-2000:]}")
    assert not failures, "\n".join(failures)


if __name__ == "__main__":  # the script probe's own interpreter (see start_probe)
    _probe_main()
