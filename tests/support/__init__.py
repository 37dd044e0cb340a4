"""What the test files share: tiny configs, the parity oracle, the HF tiny models, the
process runners (gloo worker pools, torchrun, ``python train.py``) and the fault
injectors. Test files import from here, never from each other."""
