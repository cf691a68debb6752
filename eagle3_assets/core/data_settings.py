"""Where every asset's files live: the data store's one setting, ``EAGLE3_DATA_DIR``, and its launch-time check."""

from __future__ import annotations

import tempfile
from pathlib import Path

from eagle3_assets.core import settings
from eagle3_assets.core.settings import ConfigError, SettingsModel, setting
from eagle3_assets.core.storage import DataLayout


def check_writable_dir(root: Path, key: str, value: str) -> None:
    """Write (and remove) a probe file in ``root``, or in its nearest existing ancestor when it does not exist yet
    (nothing is left behind): a run fails at its start with the key and the remedy, not with a raw OSError on the
    first lock file (``_locks``) deep inside a step."""
    folder = root.absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        if not folder.is_dir():
            raise NotADirectoryError(20, f"{folder} is not a directory")
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".eagle3-write-check-"):
            pass
    except OSError as error:
        raise ConfigError(
            f"{key}={value!r}: cannot write there ({type(error).__name__}: {error.strerror or error}); set {key} to "
            "a folder this user can write (or fix its permissions, mount or free space)"
        ) from None


class DataStoreSettings(SettingsModel):
    """Where every asset's files live. One folder per asset, one file per partition."""

    data_dir: str = setting("./data", env="EAGLE3_DATA_DIR", check=settings.check_not_blank)
    """Root of every asset's files (one folder per asset)."""

    def check_usable(self) -> None:
        """A folder (or a path where one can be made) this user can write; ConfigError naming the key if not."""
        root = Path(self.data_dir).expanduser()
        if root.exists() and not root.is_dir():
            raise ConfigError(f"EAGLE3_DATA_DIR={self.data_dir!r}: exists and is not a directory")
        check_writable_dir(root, "EAGLE3_DATA_DIR", self.data_dir)

    @property
    def layout(self) -> DataLayout:
        return DataLayout.at(self.data_dir)
