"""``python -m lightning_qcomm``: the same LightningCLI as the ``lightning-qcomm`` console script."""

from lightning_qcomm.cli import main

if __name__ == "__main__":
    main()
