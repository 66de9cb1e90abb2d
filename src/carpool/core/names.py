"""The names the three components agree on: API group, resources, annotations, labels.

Change them here, deliberately; every component imports them from this one place.
"""

from typing import Final

GROUP: Final = "carpool.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"

GPUJOB_PLURAL: Final = "gpujobs"
PROJECTQUOTA_PLURAL: Final = "projectquotas"
GPUNODE_PLURAL: Final = "gpunodes"

# Extended resources, per container.
RESOURCE_GPU: Final = f"{GROUP}/gpu"  # GPUs (each on a distinct physical GPU); shares on the node
RESOURCE_GPU_MEMORY: Final = f"{GROUP}/gpu-memory"  # GiB per GPU, extender-managed
RESOURCE_GPU_CORES: Final = f"{GROUP}/gpu-cores"  # % of SMs per GPU, extender-managed

# Pod annotations written by the operator (what the job asks for).
ANN_JOB: Final = f"{GROUP}/job"  # "<namespace>/<name>" of the owning GpuJob
# the uid of the GpuJob the operator created the pod for: still names the job once its
# ownerReference is gone (a deletion with propagationPolicy Orphan, a tampered pod)
ANN_JOB_UID: Final = f"{GROUP}/job-uid"
ANN_ISOLATION: Final = f"{GROUP}/isolation"
ANN_MODELS: Final = f"{GROUP}/models"  # comma-separated allowed GPU models
ANN_DATASET: Final = f"{GROUP}/dataset"  # dataset name
ANN_DATASET_SIZE: Final = f"{GROUP}/dataset-size-gib"
ANN_POLICY: Final = f"{GROUP}/placement-policy"  # binpack | spread (per job override)
ANN_SIM_DURATION: Final = f"{GROUP}/simulated-duration"  # seconds; KWOK completes the pod then
# A gang's worker pod: its rank (0 = the attempt's recorded pod), and the node and GPUs the
# admission cycle chose for it (the assignment codec's JSON); the extender binds it there
ANN_WORKER_RANK: Final = f"{GROUP}/worker-rank"
ANN_PLANNED: Final = f"{GROUP}/planned-assignment"
# "<attempt>/<workers>": the extender binds no worker of that attempt before all exist
ANN_GANG: Final = f"{GROUP}/gang"

# Pod annotations written by the extender at bind (the assignment) and the device plugin
# (the hand-over). See deviceplugin/README.md for the protocol.
# JSON: {"node": ..., "gpus": [{uuid, index, memoryMiB, cores, migInstance?, container?}]}
ANN_ASSIGNMENT: Final = f"{GROUP}/assignment"
ANN_ASSIGNED_AT: Final = f"{GROUP}/assigned-at"  # RFC 3339, the extender's bind time
ANN_ALLOCATED: Final = f"{GROUP}/allocated"  # device IDs the kubelet handed over, set by the plugin

LABEL_JOB: Final = f"{GROUP}/job-name"
LABEL_PROJECT: Final = f"{GROUP}/project"
LABEL_MANAGED: Final = f"{GROUP}/managed"
LABEL_SHARING: Final = f"{GROUP}/sharing"  # node label: mps | mig | timeslice | exclusive
LABEL_ZONE: Final = "topology.kubernetes.io/zone"

SCHEDULER_NAME: Final = "carpool-scheduler"
PRIORITY_CLASS: Final = "carpool-job"  # preemptionPolicy Never: only Carpool preempts
FINALIZER: Final = f"{GROUP}/accounting"
