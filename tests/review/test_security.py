"""Security of the desk: CSP without inline scripts, escaping, and a deploy check."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ledger.states import State
from tests.factories import OperationFactory

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = sorted(ROOT.glob("*/templates/**/*.html"))  # config/, review/, demo/, ledger/


@pytest.mark.django_db
def test_pages_carry_a_csp_without_unsafe_inline_and_scripts_carry_its_nonce(client, reviewer):
    op = OperationFactory(state=State.OUTCOME_UNKNOWN)
    client.force_login(reviewer)
    response = client.get(f"/operations/{op.operation_id}/")
    policy = response["Content-Security-Policy"]
    assert "unsafe-inline" not in policy and "unsafe-eval" not in policy
    nonce = re.search(r"'nonce-([^']+)'", policy).group(1)
    scripts = re.findall(r"<script[^>]*>", response.content.decode())
    assert scripts, "expected htmx to be loaded"
    for tag in scripts:
        assert f'nonce="{nonce}"' in tag and 'src="/static/' in tag


def test_no_template_marks_anything_safe_or_inlines_scripts_or_styles():
    assert TEMPLATES
    for path in TEMPLATES:
        text = path.read_text()
        assert "|safe" not in text and "autoescape off" not in text, path
        assert not re.search(r"<script(?![^>]*\bsrc=)", text), path
        assert "style=" not in text and "<style" not in text, path
        assert "http://" not in text and "https://" not in text, path


def test_manage_check_deploy_passes_with_production_settings():
    env = dict(os.environ)
    env.update(
        DJANGO_ENV="production",
        DJANGO_SECRET_KEY="x7!" + "k" * 30 + "Qz9#" + "m" * 30 + "-production-like-key",
        DJANGO_ALLOWED_HOSTS="desk.example.com",
        DATABASE_URL="postgres://ledger@127.0.0.1:5432/ledger",
    )
    env.pop("LEDGER_DATABASE_NAME", None)
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)  # set by the browser tests for themselves
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_production_settings_refuse_to_start_without_a_secret_key():
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SECRET_KEY"}
    env.update(DJANGO_ENV="production", DJANGO_ALLOWED_HOSTS="desk.example.com",
               DATABASE_URL="postgres://ledger@127.0.0.1:5432/ledger")
    result = subprocess.run([sys.executable, "manage.py", "check", "--deploy"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "DJANGO_SECRET_KEY" in result.stderr
