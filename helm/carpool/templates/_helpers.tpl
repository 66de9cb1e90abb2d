{{/* Names and labels shared by every template. */}}

{{- define "carpool.fullname" -}}
{{- if contains "carpool" .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-carpool" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "carpool.labels" -}}
app.kubernetes.io/name: carpool
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "operator") */}}
{{- define "carpool.selector" -}}
app.kubernetes.io/name: carpool
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "carpool.componentLabels" -}}
{{ include "carpool.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "carpool.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "carpool.extenderService" -}}
{{- printf "%s-extender" (include "carpool.fullname" .) -}}
{{- end -}}

{{/* The extender's URL as kube-scheduler calls it (verbs are appended): the pinned ClusterIP
when extender.serviceClusterIP is set (no cluster DNS needed), else the Service's DNS name. */}}
{{- define "carpool.extenderURL" -}}
{{- if .Values.extender.serviceClusterIP -}}
{{- printf "http://%s:%d/" .Values.extender.serviceClusterIP (int .Values.extender.port) -}}
{{- else -}}
{{- printf "http://%s.%s.svc:%d/" (include "carpool.extenderService" .) .Release.Namespace (int .Values.extender.port) -}}
{{- end -}}
{{- end -}}

{{- define "carpool.podSecurity" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "carpool.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* The KubeSchedulerConfiguration of carpool-scheduler (its ConfigMap and checksum). */}}
{{- define "carpool.schedulerConfig" -}}
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
leaderElection:
  leaderElect: true
  resourceName: carpool-scheduler
  resourceNamespace: {{ .Release.Namespace }}
profiles:
  - schedulerName: carpool-scheduler
    {{- with .Values.scheduler.percentageOfNodesToScore }}
    percentageOfNodesToScore: {{ . }}
    {{- end }}
extenders:
  - urlPrefix: {{ include "carpool.extenderURL" . | quote }}
    filterVerb: filter
    prioritizeVerb: prioritize
    bindVerb: bind
    weight: {{ .Values.scheduler.extenderWeight }}
    enableHTTPS: false
    nodeCacheCapable: true
    httpTimeout: {{ .Values.scheduler.extenderTimeout }}
    ignorable: false
    managedResources:
      - {name: carpool.dev/gpu, ignoredByScheduler: true}
      - {name: carpool.dev/gpu-memory, ignoredByScheduler: true}
      - {name: carpool.dev/gpu-cores, ignoredByScheduler: true}
{{- end -}}
