"""The scorer both sides run: a delivered answer re-read under the real model (`scorer.verify`),
and the llama.cpp pieces a host's runner and the verifier share, so both read a job alike:
the model loaded (`scorer.llama.load_llama`), the prompt tokenized (`PromptTokenizer`), a
`response_format`'s grammar (`grammar_for`, `Grammar`) and text a job resumes, healed
(`scorer.healing`).

Below the gateway and the host client both: the gateway's workers audit with it, a trusted
host scores audits with it (`mahout.scoring`), and mahout's runners sample with its pieces.
No Django here, and nothing of either side's.
"""
