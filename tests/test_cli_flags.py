"""One spelling of the checkpoint flag in every command (``--ckpt_path``, Lightning's), the old ``--ckpt`` still
read with a deprecation line, and a mistyped flag named with the nearest one by every command."""

from __future__ import annotations

import pytest

import main as cli
from qat_app.cli_errors import CHECKPOINT_FLAG, DEPRECATED_FLAGS, replace_deprecated_flags
from qat_app.export.cli import export_parser
from qat_app.inspection import inspect_parser


def _run(argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as stop:
        cli.main([str(a) for a in argv])
    return stop.value.code, capsys.readouterr().err


def test_the_old_spelling_is_rewritten_once_with_one_line():
    said = []
    assert replace_deprecated_flags(["--ckpt", "a", "--ckpt=b", "--ckpt_path", "c"], said.append) == \
        ["--ckpt_path", "a", "--ckpt_path=b", "--ckpt_path", "c"]
    assert said == ["warning: --ckpt is deprecated; use --ckpt_path (the same flag in every command)"]
    assert DEPRECATED_FLAGS == {"--ckpt": CHECKPOINT_FLAG}


def test_export_reads_the_old_checkpoint_flag(tmp_path, capsys):
    code, err = _run(["export", "--ckpt", tmp_path / "nope.ckpt", "--out", tmp_path / "out"], capsys)
    assert code == 2
    assert "warning: --ckpt is deprecated; use --ckpt_path" in err
    assert f"checkpoint {tmp_path / 'nope.ckpt'} does not exist (--ckpt_path)" in err
    assert not (tmp_path / "out").exists()


def test_fit_reads_the_old_checkpoint_flag(tmp_path, capsys):
    code, err = _run(["fit", "--config", "configs/quickstart.yaml", "--ckpt", tmp_path / "nope.ckpt"], capsys)
    assert code == 2
    assert "warning: --ckpt is deprecated" in err and err.rstrip().endswith("does not exist (--ckpt_path)")


def test_inspect_without_a_config_says_what_to_give(capsys):
    code, err = _run(["inspect", "--ckpt", "run/last.ckpt"], capsys)
    assert code == 2
    assert "warning: --ckpt is deprecated" in err
    assert "error: missing --data: give the run's --config FILE" in err
    assert "validate.data" not in err


def test_every_command_spells_the_checkpoint_flag_alike():
    assert CHECKPOINT_FLAG in export_parser("export")._option_string_actions
    assert "--ckpt" not in export_parser("export")._option_string_actions  # the old one only through the rewrite
    # inspect passes --ckpt_path to validate's parser (Lightning's own flag), so it must not define another
    assert not any(flag.startswith("--ckpt") for flag in inspect_parser("inspect")._option_string_actions)


@pytest.mark.parametrize("argv,line", [
    (["export", "--ckpt_path", "x", "--out", "y", "--ovewrite"], "unknown flag --ovewrite (did you mean --overwrite?)"),
    (["report", "--baseline", "a", "--qat", "b", "--lables", "x"], "unknown flag --lables (did you mean --labels?)"),
    (["fit", "--config", "configs/quickstart.yaml", "--model.lrr", "3"], "unknown flag --model.lrr (did you mean --model.lr?)"),
], ids=["export", "report", "fit"])
def test_a_mistyped_flag_is_named_with_the_nearest(argv, line, capsys):
    code, err = _run(argv, capsys)
    assert code == 2 and line in err


def test_flags_are_not_abbreviated(tmp_path, capsys):
    """``--comp`` could be --compare or --compute_dtype: refused, not guessed (argparse's default guesses)."""
    code, err = _run(["export", "--ckpt_path", "x", "--out", tmp_path / "o", "--comp"], capsys)
    assert code == 2 and "unknown flag --comp" in err


def _program_parsers():
    from qat_app.report.cli import report_parser
    from qat_app.study.cli import study_parser

    return {"export": export_parser("export"), "report": report_parser("report"), "inspect": inspect_parser("inspect"),
            "study": study_parser("study")}


def test_every_flag_of_every_command_takes_both_spellings_and_help_shows_one():
    """Each long flag with a separator in its name: the underscore spelling (LightningCLI's) and the dashed one are
    the same option, and the help shows the underscore one alone."""
    checked, missing = 0, []
    for command, parser in _program_parsers().items():
        help_text = parser.format_help()
        for action in parser._actions:
            for flag in action.option_strings:
                if not flag.startswith("--") or not any(c in flag[2:] for c in "-_"):
                    continue
                under, dash = "--" + flag[2:].replace("-", "_"), "--" + flag[2:].replace("_", "-")
                if flag != under:
                    continue
                checked += 1
                if dash not in action.option_strings or parser._option_string_actions.get(dash) is not action:
                    missing.append(f"{command} {under}: no {dash}")
                if dash in help_text.replace(under, ""):
                    missing.append(f"{command}: the help shows {dash}")
    assert checked >= 15 and not missing, missing  # 17 today


def test_the_dashed_spelling_still_works(tmp_path):
    ours = export_parser("export").parse_args(["--ckpt_path", "a", "--out", "b", "--compute-dtype", "float32",
                                               "--serve-target", "cuda", "--compare_batches", "3"])
    assert (ours.compute_dtype, ours.serve_target, ours.compare_batches) == ("float32", "cuda", 3)
