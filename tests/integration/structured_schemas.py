"""Twenty Pydantic models for the structured-output tests: flat and nested objects,
arrays, enums, literals, optional fields and numbers in ranges. Strings and arrays
are bounded so the small default model closes every value within a few dozen tokens."""

from enum import Enum
from typing import Annotated, Literal

from pydantic import BaseModel, Field

Short = Field(max_length=16)
Word = Annotated[str, Field(max_length=16)]


class Colour(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Size(str, Enum):
    small = "small"
    large = "large"


class City(BaseModel):
    name: str = Short
    country: str = Short


class Person(BaseModel):
    name: str = Short
    age: int = Field(ge=0, le=120)


class Flag(BaseModel):
    enabled: bool


class Paint(BaseModel):
    colour: Colour


class Shirt(BaseModel):
    colour: Colour
    size: Size


class Score(BaseModel):
    value: float = Field(ge=0, le=10)


class Tags(BaseModel):
    tags: list[Word] = Field(max_length=3)


class Numbers(BaseModel):
    numbers: list[int] = Field(max_length=4)


class Address(BaseModel):
    street: str = Short
    city: City


class Team(BaseModel):
    name: str = Short
    members: list[Person] = Field(max_length=2)


class Mood(BaseModel):
    mood: Literal["happy", "sad", "calm"]


class Book(BaseModel):
    title: str = Short
    pages: int = Field(ge=1, le=2000)
    genre: Literal["fiction", "science", "history"]


class Point(BaseModel):
    x: int = Field(ge=-100, le=100)
    y: int = Field(ge=-100, le=100)


class Line(BaseModel):
    start: Point
    end: Point


class Palette(BaseModel):
    colours: list[Colour] = Field(max_length=3)


class Answer(BaseModel):
    answer: Literal["yes", "no"]
    confidence: float = Field(ge=0, le=1)


class Weather(BaseModel):
    city: str = Short
    celsius: int = Field(ge=-50, le=50)
    sky: Literal["sunny", "cloudy", "rain"]


class Order(BaseModel):
    item: str = Short
    quantity: int = Field(ge=1, le=9)
    gift: bool


class Profile(BaseModel):
    person: Person
    home: City
    likes: list[Mood] = Field(max_length=2)


class Matrix(BaseModel):
    rows: list[list[int]] = Field(max_length=2)


MODELS: list[tuple[type[BaseModel], str]] = [
    (City, "Name a city and its country."),
    (Person, "Describe a person."),
    (Flag, "Is the feature enabled?"),
    (Paint, "Pick a paint colour."),
    (Shirt, "Describe a shirt."),
    (Score, "Rate this film from 0 to 10."),
    (Tags, "Give tags for a blog post about cooking."),
    (Numbers, "List some small numbers."),
    (Address, "Give an address."),
    (Team, "Describe a small team."),
    (Mood, "How do you feel?"),
    (Book, "Describe a book."),
    (Point, "Give a point on a grid."),
    (Line, "Give a line segment."),
    (Palette, "Choose a palette."),
    (Answer, "Is the sky blue?"),
    (Weather, "What is the weather in Paris?"),
    (Order, "Place an order."),
    (Profile, "Write a profile."),
    (Matrix, "Write a small matrix."),
]
