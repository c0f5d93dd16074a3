"""A fixture shared by the test modules whose weight files are views."""
import pytest


@pytest.fixture(autouse=True)
def layout_files_are_views(monkeypatch):
    """The weight files of a module that imports this are a few stored values expanded to each
    shape (ResNet-101's layout in kilobytes), views the one door of file reads refuses
    (tests/test_bounded_reads.py, tests/test_weight_file_reads.py). Those modules' tests are
    about keys, shapes and values, so the overlap rule is lifted for them, and only for them
    (importing the fixture makes it autouse in that module alone)."""
    monkeypatch.setattr("mars_plugin.formats.bounded_load.overlapping", lambda *a, **k: False)
