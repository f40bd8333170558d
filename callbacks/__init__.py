"""V17 callbacks, installed as ``lightning_v17.callbacks`` (setuptools package-dir maps this folder there)."""

if __name__ != "lightning_v17.callbacks":  # pragma: no cover - guards against `import callbacks`
    raise ImportError(
        f"this folder must be imported as 'lightning_v17.callbacks', not {__name__!r}; "
        "install the package (`pip install -e .`) and import it absolutely"
    )

__all__: list[str] = []
