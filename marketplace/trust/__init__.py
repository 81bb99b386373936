"""Trust in hosts: how the gateway checks what hosts deliver and whom it sends work to.

    audits          a delivered answer re-read under the real model (`scorer.verify`)
    ring_inquiries  a ring's failed audit: which stage lied
    scorer_fees     what a host that scores an audit is paid
    reputation      probation, strikes and trust grants
    routing         which host a job is offered to
    redundancy      idle hosts asked to keep a model warm

The lifecycle's stages call these rooms; these rooms import none of the lifecycle's.
"""
