"""The Pod Security Standard `restricted` profile (Kubernetes 1.30 rules), checked on a pod spec (pure).

What the admission controller would refuse in a namespace labelled
`pod-security.kubernetes.io/enforce: restricted`, as `where: why` strings (none: the pod is admitted).
"""

from __future__ import annotations

ALLOWED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
                   "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}


def restricted_violations(pod: dict) -> list[str]:
    found = []
    security = pod.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            found.append(f"spec.{key}: must be false")
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            found.append(f"volumes[{volume['name']}]: {', '.join(sorted(kinds - ALLOWED_VOLUMES))} not allowed")
    for sysctl in security.get("sysctls") or []:
        if sysctl["name"] not in SAFE_SYSCTLS:
            found.append(f"securityContext.sysctls: {sysctl['name']} is not a safe sysctl")
    if security.get("runAsUser") == 0:
        found.append("securityContext.runAsUser: must not be 0")
    containers = [*(pod.get("initContainers") or []), *(pod.get("containers") or []),
                  *(pod.get("ephemeralContainers") or [])]
    for container in containers:
        where, context = f"containers[{container['name']}].securityContext", container.get("securityContext") or {}
        if context.get("privileged"):
            found.append(f"{where}.privileged: must be false")
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{where}.allowPrivilegeEscalation: must be false")
        caps = context.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            found.append(f"{where}.capabilities.drop: must include ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            found.append(f"{where}.capabilities.add: only NET_BIND_SERVICE")
        if not (context.get("runAsNonRoot") or security.get("runAsNonRoot")) or context.get("runAsNonRoot") is False:
            found.append(f"{where}.runAsNonRoot: must be true (here or in the pod)")
        if context.get("runAsUser") == 0:
            found.append(f"{where}.runAsUser: must not be 0")
        seccomp = (context.get("seccompProfile") or security.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{where}.seccompProfile: RuntimeDefault or Localhost (here or in the pod)")
        if (context.get("seLinuxOptions") or {}).get("user") or (context.get("seLinuxOptions") or {}).get("role"):
            found.append(f"{where}.seLinuxOptions: user and role must be unset")
        if context.get("procMount", "Default") != "Default":
            found.append(f"{where}.procMount: must be Default")
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                found.append(f"containers[{container['name']}].ports: hostPort not allowed")
    return found


def pod_specs(objects: list[dict]) -> list[tuple[str, dict]]:
    """(kind/name, pod spec) of every workload among rendered objects."""
    out = []
    for obj in objects:
        spec = obj.get("spec") or {}
        if obj.get("kind") == "Pod":
            out.append((f"Pod/{obj['metadata']['name']}", spec))
        elif obj.get("kind") in ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"):
            out.append((f"{obj['kind']}/{obj['metadata']['name']}", spec["template"]["spec"]))
        elif obj.get("kind") == "CronJob":
            out.append((f"CronJob/{obj['metadata']['name']}", spec["jobTemplate"]["spec"]["template"]["spec"]))
    return out


def kuberay_pods(rayjob: dict) -> list[tuple[str, dict]]:
    """(role, pod spec) of every pod KubeRay makes for a RayJob, as KubeRay makes them: the head and worker
    templates; in each worker, the `wait-gcs-ready` init container KubeRay injects with the Ray container's
    securityContext; and the submitter Job's pod: the RayJob's `submitterPodTemplate`, else KubeRay's
    default (one container with the head's image and no securityContext)."""
    cluster = rayjob["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    pods = [("head", head)]
    for group in cluster.get("workerGroupSpecs") or []:
        worker = group["template"]["spec"]
        ray = worker["containers"][0]
        injected = {"name": "wait-gcs-ready", "image": ray["image"], "securityContext": ray.get("securityContext")}
        pods.append((f"worker/{group['groupName']}", {**worker, "initContainers": [*(worker.get("initContainers")
                                                                                     or []), injected]}))
    if rayjob["spec"].get("submissionMode", "K8sJobMode") == "K8sJobMode":
        default = {"restartPolicy": "Never", "containers": [{"name": "ray-job-submitter",
                                                             "image": head["containers"][0]["image"]}]}
        pods.append(("submitter", (rayjob["spec"].get("submitterPodTemplate") or {}).get("spec") or default))
    return pods
