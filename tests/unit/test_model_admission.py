"""One model's admission state (gateway/flow/model_admission.py): each flow calibrated on its own."""

from gateway.flow.model_admission import ModelAdmission
from gateway.flow.return_schedules import ReturnSchedules
from policies.admission import AdmissionConfig
from policies.calibration import starting_confidence

CONFIG = AdmissionConfig()


def model(bands=2):
    return ModelAdmission(bands, CONFIG, ReturnSchedules(bands, CONFIG.retry), jitter=lambda: 0.5)


def test_each_flow_is_calibrated_on_its_own_and_a_new_one_starts_from_its_bands():
    admission = model()
    start = starting_confidence(CONFIG.safety_sigmas, CONFIG.calibration)
    assert admission.confidence(0, "costly") == start
    for _ in range(50):  # the cheap tenant's admitted requests are served in time
        band_wide = admission.settled(0, "cheap", expired=False)
    for _ in range(5):  # the costly one's expire
        band_wide = admission.settled(0, "costly", expired=True)
    assert admission.confidence(0, "costly") > start > admission.confidence(0, "cheap")
    assert band_wide == admission.band_confidence(0)
    assert admission.confidence(0, "new") == band_wide  # what the band has learned
    assert admission.confidence(1, "costly") == start  # another band learned nothing


def test_a_costly_request_gets_a_smaller_share_of_a_contended_queues_room():
    admission = model()
    for cost in (1.0, 1.0, 1.0, 2.0):
        admission.room_share(0, cost)
    assert admission.room_share(0, 8.0) < admission.room_share(0, 1.0)
