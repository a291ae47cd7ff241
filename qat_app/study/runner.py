"""Running a study: each run as its own ``main.py`` process, resumable, then the reports.

Bookkeeping lives in ``<out_dir>/_study/`` (never inside a run directory, so a run started by hand from
``--dry_run`` is the same directory): ``<name>.json`` (the command, every attempt's wall time and exit code,
whether it finished), ``<name>.log`` (the run's output), ``lock`` (the pid of the study process running).
A finished run is skipped; an unfinished one is started again with ``--ckpt_path last``, which resumes it
from its newest intact checkpoint (or starts it afresh when it has none).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from .commands import RunCommand, all_commands
from .spec import Study, StudyError

STATE_DIR = "_study"


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)  # a crash mid-write leaves the old state, never half a file


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the run gets SIGTERM when the study process dies, so a killed study leaves no orphan run."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class StudyRunner:
    def __init__(self, study: Study, echo=print):
        self.study = study
        self.echo = echo
        self.state_dir = Path(study.out_dir) / STATE_DIR

    # -- state -------------------------------------------------------------------------------------------
    def state_file(self, name: str) -> Path:
        return self.state_dir / f"{name}.json"

    def log_file(self, name: str) -> Path:
        return self.state_dir / f"{name}.log"

    def state(self, name: str) -> dict | None:
        path = self.state_file(name)
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise StudyError(f"{path}: unreadable study state ({err}); delete it to run {name!r} again") from None

    def finished(self, command: RunCommand) -> dict | None:
        """The state of a finished run, None if it has not finished; refuses a run finished with other settings."""
        state = self.state(command.name)
        if not state or not state.get("finished"):
            return None
        if state.get("argv") != command.argv:
            raise StudyError(
                f"run {command.name!r} finished with other settings than the study file now gives\n"
                f"  then: {' '.join(state.get('argv', []))}\n  now:  {' '.join(command.argv)}\n"
                f"  to run it again with the new settings, delete {command.run_dir} and {self.state_file(command.name)}")
        return state

    def _acquire_lock(self) -> Path:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        lock = self.state_dir / "lock"
        if lock.is_file():
            try:
                pid = int(lock.read_text().strip() or 0)
                os.kill(pid, 0)
            except (ValueError, ProcessLookupError):
                pass  # a stale lock of a study that was killed
            except PermissionError:
                raise StudyError(f"{lock}: another study process (pid {pid}) is running this study") from None
            else:
                if pid != os.getpid():
                    raise StudyError(f"{lock}: another study process (pid {pid}) is running this study")
        lock.write_text(str(os.getpid()))
        return lock

    # -- running -----------------------------------------------------------------------------------------
    def execute(self, command: RunCommand) -> dict:
        state = self.state(command.name) or {"name": command.name}
        state.update(argv=command.argv, shell=command.shell(), finished=False)
        attempts = state.setdefault("attempts", [])
        started = time.monotonic()
        attempts.append({"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "wall_s": None,
                         "exit_code": None})
        _write_json(self.state_file(command.name), state)
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        with open(self.log_file(command.name), "a") as log:
            log.write(f"\n$ {command.shell()}\n")
            log.flush()
            code = subprocess.call(command.executable(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                   preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        attempts[-1].update(wall_s=round(time.monotonic() - started, 1), exit_code=code)
        state["finished"] = code == 0
        state["wall_s"] = round(sum(a["wall_s"] or 0 for a in attempts), 1)
        _write_json(self.state_file(command.name), state)
        if code != 0:
            tail = self.log_file(command.name).read_text().splitlines()[-15:]
            raise StudyError(f"run {command.name!r} failed (exit code {code}); its output: "
                             f"{self.log_file(command.name)}\n  " + "\n  ".join(tail), exit_code=1)
        return state

    def run(self, only: list[str] | None = None) -> list[dict]:
        """Run every command (or the ``only`` ones) that has not finished; returns their states in order."""
        commands = all_commands(self.study)
        selected = [c for c in commands if not only or c.name in only]
        lock = self._acquire_lock()
        states = []
        try:
            for i, command in enumerate(selected, start=1):
                done = self.finished(command)
                tag = f"[{i}/{len(selected)}] {command.name}"
                if done:
                    self.echo(f"{tag}: finished earlier ({done['wall_s']:.0f} s), skipped")
                    states.append(done)
                    continue
                resumed = " (resuming)" if self.state(command.name) else ""
                self.echo(f"{tag}: running{resumed}; output in {self.log_file(command.name)}")
                state = self.execute(command)
                self.echo(f"{tag}: done in {state['attempts'][-1]['wall_s']:.0f} s")
                states.append(state)
        finally:
            lock.unlink(missing_ok=True)
        return states
