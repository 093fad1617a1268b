"""The dashboard's control token: new each start, or kept in a file only its owner can read."""

from __future__ import annotations

import os
import stat

import pytest

from dispatcher.dashboard.app import TokenFileError, load_token


def test_a_token_file_is_created_0600_and_read_back(tmp_path):
    path = tmp_path / "dashboard.token"
    token = load_token(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(token) >= 32
    assert load_token(path) == token
    assert load_token(None) != load_token(None)  # without a file: a new one each start


def test_a_token_file_others_can_read_is_refused(tmp_path):
    path = tmp_path / "dashboard.token"
    path.write_text("shared\n")
    os.chmod(path, 0o644)
    with pytest.raises(TokenFileError, match="0644"):
        load_token(path)
