"""Backends from outside the package: registered at run time, or by an installed package's entry
point; what the registry refuses."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult

import pytest
import torch

import amber_store as amber
from amber_store import storage
from amber_store.storage.local import LocalBackend
from conftest import assert_tree_bit_equal


class ScratchBackend(LocalBackend):
    """``scratch://name``: a store named by a site's own scheme, under its scratch directory
    (``SCRATCH_ROOT``), as a cluster's storage layer might serve one."""

    @classmethod
    def from_uri(cls, uri: str, parts: SplitResult, storage_options: dict[str, Any],
                 read_only: bool) -> "ScratchBackend":
        return cls(Path(os.environ["SCRATCH_ROOT"]) / (parts.netloc + parts.path), read_only)


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict:
    """The registry as it was, restored after the test; scratch:// stores under tmp_path."""
    monkeypatch.setattr(storage.registry, "BACKENDS", dict(storage.registry.BACKENDS))
    monkeypatch.setenv("SCRATCH_ROOT", str(tmp_path / "scratch"))
    return storage.registry.BACKENDS


def round_trip(uri: str) -> None:
    state = {"w": torch.randn(64, 64), "step": 3}
    with amber.open(uri, mode="w") as store:
        store.save(1, state)
        state["w"].add_(1e-3)
        store.save(2, state)
    assert_tree_bit_equal(amber.open(uri, mode="r").load(2, lazy=False), state)


def test_a_backend_registered_from_outside_the_package_serves_its_scheme(registry, tmp_path):
    storage.register("scratch", ScratchBackend)
    round_trip("scratch://run-1")
    assert (tmp_path / "scratch" / "run-1").is_dir()
    assert "scratch://" in storage.supported()


def test_a_backend_registered_by_name_is_imported_when_a_uri_first_names_it(registry, tmp_path):
    storage.register("scratch", f"{__name__}:ScratchBackend")
    assert registry["scratch"] == f"{__name__}:ScratchBackend"
    round_trip("scratch://run-2")
    assert registry["scratch"] is ScratchBackend


def test_an_installed_packages_entry_point_serves_its_scheme_without_registering(registry, tmp_path, monkeypatch):
    # a distribution installed on the path: its module, its metadata and its entry point
    site = tmp_path / "site"
    (site / "acme_storage").mkdir(parents=True)
    (site / "acme_storage" / "__init__.py").write_text(textwrap.dedent('''
        import os
        from pathlib import Path
        from amber_store.storage.local import LocalBackend

        class AcmeBackend(LocalBackend):
            @classmethod
            def from_uri(cls, uri, parts, storage_options, read_only):
                return cls(Path(os.environ["SCRATCH_ROOT"]) / "acme" / parts.netloc, read_only)
    '''))
    info = site / "acme_storage-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-storage\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{storage.ENTRY_POINTS}]\nacme = acme_storage:AcmeBackend\n")
    monkeypatch.syspath_prepend(str(site))
    assert "acme" not in registry
    round_trip("acme://bucket")
    assert (tmp_path / "scratch" / "acme" / "bucket").is_dir()
    assert registry["acme"].__name__ == "AcmeBackend"
    monkeypatch.delitem(sys.modules, "acme_storage")


def test_the_registry_refuses_what_would_not_serve_a_uri(registry):
    with pytest.raises(ValueError, match="is served already"):
        storage.register("s3", ScratchBackend)
    storage.register("s3", ScratchBackend, clobber=True)
    assert registry["s3"] is ScratchBackend
    with pytest.raises(ValueError, match="not a URI scheme"):
        storage.register("9p", ScratchBackend)
    with pytest.raises(TypeError, match="not a subclass"):
        storage.register("scratch", dict)  # type: ignore[arg-type]
    storage.register("nomodule", "no_such_module_here:Backend")
    with pytest.raises(amber.InvalidURIError, match="needs 'no_such_module_here'"):
        amber.open("nomodule://x")
    storage.register("notabackend", "collections:OrderedDict")
    with pytest.raises(amber.InvalidURIError, match="not a subclass"):
        amber.open("notabackend://x")
    with pytest.raises(amber.InvalidURIError, match="unsupported URI scheme 'nosuch'.*storage.register"):
        amber.open("nosuch://x")
