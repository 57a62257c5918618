"""Runtime policy documents (§16.3): validation and canonical form."""

from __future__ import annotations

import json

import pytest

from runtime_svc.definitions.policy import (
    DEFAULT_POLICY_DOCUMENT,
    PolicyGeneration,
    normalize_policy_document,
    policy_document_digest,
)
from services.errors import InvalidArgumentError


def test_the_default_policy_is_a_valid_compiler_policy() -> None:
    doc = normalize_policy_document(DEFAULT_POLICY_DOCUMENT)
    assert "version" not in doc
    gen = PolicyGeneration("org", 4, doc, policy_document_digest(doc))
    policy = gen.runtime_policy()
    assert policy.version == 4
    assert policy.bounded_atomic.max_writes == 200
    assert gen.compiler_document()["version"] == 4


def test_documents_compare_canonically_and_ignore_a_version() -> None:
    doc = normalize_policy_document(DEFAULT_POLICY_DOCUMENT)
    shuffled = json.loads(json.dumps(DEFAULT_POLICY_DOCUMENT))
    shuffled["bounded_atomic"]["lock_classes"].reverse()
    shuffled["version"] = 17
    again = normalize_policy_document(shuffled)
    assert again == doc and policy_document_digest(again) == policy_document_digest(doc)
    gen = PolicyGeneration("org", 1, doc, policy_document_digest(doc))
    assert gen.same_document(again)
    shuffled["bounded_atomic"]["max_fanout"] = 10
    assert not gen.same_document(normalize_policy_document(shuffled))


@pytest.mark.parametrize(
    ("patch", "path"),
    [
        ({"bounded_atomic": {"max_steps": 1}}, "policy"),
        ({"max_wait_seconds": "soon"}, "policy"),
        ({"legacy_atomic_mapping": "sometimes"}, "policy"),
        ({"retry": {"max": 3}}, "policy.retry"),
    ],
)
def test_invalid_documents_are_rejected(patch: dict, path: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        normalize_policy_document({**DEFAULT_POLICY_DOCUMENT, **patch})
    assert err.value.field_path == path
