{{- define "kvd.labels" -}}
app.kubernetes.io/name: kvd
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}
{{- define "kvd.selector" -}}
app.kubernetes.io/name: kvd
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
