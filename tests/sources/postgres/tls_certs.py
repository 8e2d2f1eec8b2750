"""A test CA, a server certificate it signed and another CA, made with openssl."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

CA_NAME = "changestreamer test CA"


def make_certs(root: Path) -> Path | None:
    """A CA, a server certificate it signed (localhost, 127.0.0.1), and another CA."""
    if shutil.which("openssl") is None:
        return None
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2"]

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=root, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-subj", f"/CN={CA_NAME}")
    openssl(
        "req", "-x509", *ec, "-keyout", "other-ca.key", "-out", "other-ca.crt", "-subj", "/CN=x"
    )
    openssl(
        "req", *ec[:-2], "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost"
    )
    (root / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "san.ext",
    )  # fmt: skip
    return root
