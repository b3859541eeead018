"""The unknown-outcome policies page (admins): what an unproven outcome of each kind of
operation may become, the defaults from the setting, and the audited changes.

Thin like the rest of the desk: the write is one `ledger.outcome_policies.set_policy` call,
which checks the permission and the tenant again and records who, why, before and after
(the page itself: review/policy_pages.py).
"""

from __future__ import annotations

from ledger import outcome_policies
from review.forms_outcome_policies import UnknownOutcomePolicyForm
from review.policy_pages import policy_page

policies, set_policy = policy_page(
    form_class=UnknownOutcomePolicyForm, read=outcome_policies.policies_page,
    write=outcome_policies.set_policy, template="review/outcome_policies.html",
    noun="Unknown-outcome policy", url_name="review:outcome_policies",
    view_permission="ledger.view_unknownoutcomepolicy",
    change_permission="ledger.change_unknownoutcomepolicy",
)
