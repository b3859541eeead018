from django.urls import path

from demo import views

app_name = "demo"

urlpatterns = [
    path("webhook-catcher/", views.webhook_catcher, name="webhook_catcher"),
]
