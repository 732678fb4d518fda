"""The web app's one refusal besides the access policy's: input a command refuses, as a 4xx with one line."""

from __future__ import annotations


class BadRequest(Exception):
    """Input the command refuses: 400 (or ``status``) with its one line."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
