"""Holds are sealed before they reach a shared index: AES-GCM keyed from the cluster secret.

A hold's params carry the token ids D's blocks encode (what P's check compares the prompt with):
a conversation's content. In a Redis that other operators, backups or a replica can read, they
must not be in the clear. Every router has the cluster secret already (it signs the legs that
carry transfer params), so routers derive one key from it (HKDF-SHA256, its own label) and seal
each hold's body. The associated data is the hold's key name and its turn prefix: a value copied
to another session's key, or a turn number edited in place (what the filing script compares),
fails to open and reads as no hold — a recompute, like any other loss of the advisory index.
A process with another secret reads no holds at all (it never pulls; answers stay right).
"""

from __future__ import annotations

import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

_LABEL = b"kvbranch index hold v1"
_NONCE_BYTES = 12


class HoldCipher:
    def __init__(self, secret: bytes) -> None:
        if not secret:
            raise ValueError("the hold cipher needs the cluster secret")
        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_LABEL).derive(secret)
        self._aead = AESGCM(key)

    def seal(self, plaintext: bytes, bound_to: bytes) -> bytes:
        """``nonce ‖ ciphertext ‖ tag``; ``bound_to`` must be given again to open it."""
        nonce = os.urandom(_NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, plaintext, bound_to)

    def open(self, sealed: bytes, bound_to: bytes) -> bytes | None:
        """The plaintext, or None when ``sealed`` was made with another key, for another
        ``bound_to``, or changed at all."""
        if len(sealed) <= _NONCE_BYTES:
            return None
        try:
            return self._aead.decrypt(sealed[:_NONCE_BYTES], sealed[_NONCE_BYTES:], bound_to)
        except InvalidTag:
            return None
