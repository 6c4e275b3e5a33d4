# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv on first use.
PYTHON_VERSION := $(shell cat .python-version)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-multidevice install clean

$(STAMP): pyproject.toml
	@command -v pyenv >/dev/null && PYENV_VERSION=$$(pyenv versions --bare | grep -E '^$(PYTHON_VERSION)(\.|$$)' | tail -1) \
	  pyenv exec python -m venv $(VENV) 2>/dev/null || python$(PYTHON_VERSION) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m experiments.demo
	$(PY) -m experiments.replay --config=mini --checkpoint=checkpoints/mini --scale=40 --spec=mtp \
	  --draft_threshold=0 --output=replay_demo.json

# The main suite, and beside it a second process: the multi-device tests (8 simulated CPU
# devices, fixed when JAX's backend starts) and the tests marked side_lane (long smoke tests that
# run entry points or the notebook in their own subprocesses, which would otherwise lengthen the
# main suite, and the Pallas folds' token tests, the training tests and a few more of the
# longest, which even out the two processes' times; each file holding one is listed below); its
# log follows the main suite's.
# Either failing fails the target; pytest exits 5 when it collected nothing, and that is a
# failure here, not a pass.
test: $(STAMP)
	@$(PY) -m pytest -q -m "multidevice or side_lane" tests/test_multidevice_*.py tests/test_study.py tests/test_notebook.py \
	  tests/test_engine.py tests/test_analysis.py tests/test_pallas_engine.py tests/test_training.py \
	  tests/test_fold_chain.py tests/test_quant_model.py tests/test_mini_checkpoint.py tests/test_bench.py \
	  tests/test_quant_kernels.py > .multidevice.log 2>&1 & multi=$$!; \
	$(PY) -m pytest -q -m "not multidevice and not side_lane" --ignore-glob='tests/test_multidevice_*.py' tests; \
	main=$$?; wait $$multi; multi_rc=$$?; echo "== multi-device and side-lane tests =="; cat .multidevice.log; \
	test $$main -eq 0 && test $$multi_rc -eq 0

clean:
	rm -rf $(VENV) .venv-triton .pytest_cache .hypothesis .multidevice.log
