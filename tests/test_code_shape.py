"""benchmarks/code_shape.py counts what it says on a planted tree."""

from __future__ import annotations

import textwrap

from benchmarks import code_shape

PLANTED = '''
def three():
    return 1, 2, 3


def two():
    return 1, 2


def nested():
    def inner():
        return 1, 2, 3
    return inner


def long():
{body}


def looks(trainer):
    return [c for c in trainer.callbacks if hasattr(c, "stopped")]


def parse(name):
    operand = name.rsplit(".", 1)[-1]
    return operand_of(name), operand


def fine(name):
    return name.rsplit(".", 1)[0]
'''


def test_code_shape_counts_the_planted_sites(tmp_path, capsys):
    body = "\n".join(f"    x{i} = {i}" for i in range(40))
    (tmp_path / "qat_app").mkdir()
    (tmp_path / "callbacks").mkdir()
    (tmp_path / "qat_app" / "planted.py").write_text(textwrap.dedent(PLANTED).format(body=body))
    (tmp_path / "callbacks" / "empty.py").write_text("")
    code_shape.main([str(tmp_path), "--list"])
    out = capsys.readouterr().out
    counts = {line.split()[0]: int(line.split()[1]) for line in out.splitlines() if not line.startswith(" ")}
    # three() and inner() return 3-tuples; long() has 41 lines; one hasattr on a callback; the rsplit that names
    # an operand and the call of operand_of (not fine()'s split)
    assert counts == {"tuple_returns": 2, "long_functions": 1, "callback_hasattr": 1, "operand_from_name": 2}, out
    assert "planted.py" in out and "long (41 lines)" in out
