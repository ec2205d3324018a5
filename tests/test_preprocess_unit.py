import os
import signal

import pytest

from pipeline.preprocess.run import ctrl_c_deferred


def test_ctrl_c_waits_until_the_shard_and_its_record_are_both_written():
    finished = []
    with pytest.raises(KeyboardInterrupt):
        with ctrl_c_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            finished.append("shard written")
            finished.append("manifest saved")
    assert finished == ["shard written", "manifest saved"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
