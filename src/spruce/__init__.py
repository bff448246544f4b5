from spruce.sampling_params import SamplingParams
__all__ = ["SamplingParams"]
