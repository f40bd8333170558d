"""V17 strategies, installed as ``lightning_v17.strategies`` (setuptools package-dir maps this folder there)."""

if __name__ != "lightning_v17.strategies":  # pragma: no cover - guards against `import strategies`
    raise ImportError(
        f"this folder must be imported as 'lightning_v17.strategies', not {__name__!r}; "
        "install the package (`pip install -e .`) and import it absolutely"
    )

__all__: list[str] = []
