"""``python main.py {fit,validate,test,report,export,study,inspect,evaluate} ...``: the command line of :mod:`qat_app.cli` (also
``hif8-qat``)."""
from qat_app.cli import QATCLI, cli_main, main  # noqa: F401  (tests use main.QATCLI / main.cli_main / main.main)

if __name__ == "__main__":
    main()
